#!/usr/bin/env bash
# The throughput figures of benchmarks/RESULTS.md, on one H200 (device tool):
#   bash benchmarks/gpu_throughput.sh    (carry .whl; see benchmarks/gpu_env.sh)
set -uo pipefail
source benchmarks/gpu_env.sh
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv
python3 benchmarks/throughput.py --presets 1b --schemes prenorm,mhar_b8,mhar \
  --steps 8 --warmup 2 --timeout 240 --budget 200 --json "$OUT/tp_1b.json"
python3 benchmarks/throughput.py --presets 100m \
  --schemes prenorm,mhar,mhar_b8,attnres,hyper,mhar:reference \
  --steps 8 --warmup 2 --timeout 100 --budget 120 --json "$OUT/tp_100m.json"
python3 benchmarks/throughput.py --presets 350m --schemes prenorm,mhar_b8,mhar \
  --steps 8 --warmup 2 --timeout 100 --budget 40 --json "$OUT/tp_350m.json"
