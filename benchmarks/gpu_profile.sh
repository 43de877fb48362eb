#!/usr/bin/env bash
# Nsight Compute counters of the routing kernels at the 1b shape (one H200,
# device tool; carry .whl). Full reports: $OUT/ncu-*.txt; key lines printed.
#   bash benchmarks/gpu_profile.sh
set -uo pipefail
source benchmarks/gpu_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis \
--section SchedulerStats --section WarpStateStats --section Occupancy \
--section LaunchStats --section ComputeWorkloadAnalysis"
# XLA's GEMM autotuning crashed under ncu (segfault, session 11): off here.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"
prof() {   # name, what, kernel regex, launches to skip, launches to profile
  timeout 120 ncu --clock-control none -k "regex:$3" --launch-skip "$4" \
    -c "$5" $SECTIONS python3 benchmarks/profile_routing.py --what "$2" \
    > "$OUT/ncu-$1.txt" 2>&1
  echo "== $1 (rc $?)"
  grep -E "^  [_a-z].*\(|Duration|DRAM Throughput|Memory Throughput|L1/TEX Hit|L2 Hit Rate|Mem Busy|Max Bandwidth|Issue Slots Busy|Issued Ipc|No Eligible|Active Warps Per|Eligible Warps|Registers Per|Achieved Occupancy|Theoretical Occ|Block Limit Reg|One or More|Warp Cycles Per Issued|Compute \(SM\) Th" \
    "$OUT/ncu-$1.txt" | sed 's/  */ /g' | head -40
}
prof fwd fwd _fwd_kernel 1 1
prof fwd_r fwd_r _fwd_kernel 1 1
prof sites sites _fwd_kernel 1 1
prof fwdbwd fwdbwd "_cpass_kernel|_bwd_kernel" 2 2
prof source_grad source_grad source_grad_kernel 1 1
