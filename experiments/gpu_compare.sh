#!/usr/bin/env bash
# Runs of experiments/RESULTS.md on one H200 (device tool), carrying .whl and .data:
#   bash experiments/gpu_compare.sh RUNS [more `compare.py run` flags]
# .data/benchcorpus holds a copy of ../shared/data/benchcorpus (the raw corpus
# and tokenizer); it is tokenized here first (~30 s). Results come back in
# $OUT/compare.tgz (everything but checkpoints), re-packed after every run.
set -uo pipefail
source benchmarks/gpu_env.sh || exit 1
unset XLA_PYTHON_CLIENT_MEM_FRACTION   # compare.py shares the device per job
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SRC=.data/benchcorpus
t0=$(date +%s)
prep() {
  python3 -m mhar_jax.data.prepare --input "$SRC/$1.txt.xz" \
    --tokenizer "$SRC/tokenizer.json" --output data/benchcorpus --split "$1" \
    --workers "$2" > "$OUT/prepare_$1.log" 2>&1
}
(prep val 2 && prep val_prose 1 && prep val_code 1) & val=$!
prep train 14 || { tail -5 "$OUT/prepare_train.log"; exit 1; }
wait $val || { tail -5 "$OUT"/prepare_val*.log; exit 1; }
echo "data prepared in $(( $(date +%s) - t0 ))s"; tail -2 "$OUT/prepare_train.log"
python3 experiments/compare.py run --runs "$1" --pack "$OUT/compare.tgz" "${@:2}"
