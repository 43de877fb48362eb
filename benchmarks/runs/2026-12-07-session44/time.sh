# Session 44: time runs from the cache compile.sh wrote on the same warm machine.
#   RUNS=... [MICRO=...] bash benchmarks/runs/2026-12-07-session44/time.sh [throughput.py args]
# 1b takes one 32k microbatch on an H200, two of 16k on an H100, unless MICRO is set.
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
MICRO=${MICRO:-$(( ${MIB:-0} >= 100000 ? 32768 : 16384 ))}
RUNS="$RUNS" bash benchmarks/gpu_throughput.sh --micro_tokens $MICRO --steps 10 --warmup 3 \
  --compile_jobs 0 "$@" 2>&1 | grep -v -i warning | tail -40
