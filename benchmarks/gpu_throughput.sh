#!/usr/bin/env bash
# The throughput figures of benchmarks/RESULTS.md, on one H200 or H100 (device tool):
#   bash benchmarks/gpu_throughput.sh    (carry .whl; see benchmarks/gpu_env.sh)
# All runs compile first, 3 at a time, into a persistent cache; then each is
# timed alone. Results: $OUT/throughput.json, and the table printed last.
# To use one device call for compiles and another for timing, compile in the
# background beside the GPU tests (after `source benchmarks/gpu_env.sh`):
#   python3 benchmarks/throughput.py --runs "$RUNS" --micro_tokens 32768 \
#     --compile_only &       (on an H100: --micro_tokens 32768,1b=16384)
# then, on the same machine (the cache survives while it stays warm), this
# script times them from the cache; add `--compile_jobs 0` to skip its own
# compile phase (each run then loads from the cache once, not twice: ~55 s a
# 1b run on an H100), and give 1b runs `--timeout 150` (it counts the load).
set -uo pipefail
source benchmarks/gpu_env.sh || exit 1
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv
# Microbatches of 32k tokens, except 1b on an H100 (80 GB): its step at one
# 32k microbatch needs an H200's memory, so it takes two of 16k (the README's
# H100 rows). A --micro_tokens given to this script overrides it.
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
MICRO=32768; (( ${MIB:-0} >= 100000 )) || MICRO=32768,1b=16384
RUNS=${RUNS:-1b/prenorm,1b/mhar_b8,1b/mhar,350m/prenorm,350m/mhar_b8,\
350m/mhar,100m/prenorm,100m/hyper,100m/attnres,100m/mhar,100m/mhar_b8,\
100m/mhar_site,100m/mhar:reference,bench100m/prenorm,bench100m/mhar,bench100m/mhar_b8}
python3 benchmarks/throughput.py --runs "$RUNS" --steps 6 --warmup 2 \
  --micro_tokens "$MICRO" --compile_jobs 3 --compile_timeout 420 --compile_wait 240 \
  --timeout 150 \
  --budget 545 --json "$OUT/throughput.json" "$@"
