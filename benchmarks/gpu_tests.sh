#!/usr/bin/env bash
# The GPU tests in parts that each fit a device call, on one GPU (device
# tool; carry .whl):
#   bash benchmarks/gpu_tests.sh [PART ...]    (default: every part, in order)
# Parts (pytest -k over tests/test_stack_gpu.py unless named otherwise):
#   ffi      the stack with every kernel launched through the typed-FFI call
#   kernels  the group kernels and the query-gain product
#   f32      the stack against the reference, float32
#   bf16     ... bfloat16
#   rms      the stack with the forward kernel computing the inverse RMS
#   decoder  the decoder's source-major backward
#   outputs  the sites' outputs recomputed (recompute_site_outputs): the
#            stack with norm, every site (f32, bf16)
#   share    ... the lowest sites only (recompute_below)
#   causal   the causal sites kernel (what recomputes them in groups)
#   norm     the sublayer norms' backward kernel, alone (dy as 1-3 terms)
#            and in the stack with no site recomputed (every norm's
#            gradient by the kernel; with sublayers of three products, from
#            the three terms of dy: NORM_TUNING["dy_terms"] 3, the default)
#   route    tests/test_triton_route.py (route() alone)
#   split    the sites kernel's weights as two terms (default) and one (bf16 lead9)
# Each part's verbose output goes to $OUT/gpu-tests-PART.txt (so a part cut
# by its timeout still says which cases passed); its last lines are printed.
# Durations on an H100 (sessions 38-39; compiles dominate): f32 185 s alone;
# bf16 275-306 s beside others; outputs 317 s and ffi 285 s side by side (0.4
# of the card each); share 177 s and causal 75-88 s beside two others:
# give ffi, bf16 and outputs PART_TIMEOUT=330-340 each.
set -uo pipefail
source benchmarks/gpu_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TIMEOUT=${PART_TIMEOUT:-280}
declare -A SEL=(
  [ffi]="ffi_launch" [kernels]="group_kernels or query_gain"
  [f32]="matches_reference and float32"
  [bf16]="matches_reference and bfloat16"
  [rms]="inverse_rms" [decoder]="decoder"
  [outputs]="recomputed_site_outputs and not below"
  [share]="recomputed_site_outputs and below and not below0" [causal]="causal_sites"
  [norm]="norm_grad_kernel or below0 or adds_terms"
  [split]="split_weights or (matches_reference and bfloat16 and lead9)")
for part in ${@:-ffi kernels f32 bf16 rms decoder route outputs share causal norm}; do
  if [[ $part == route ]]; then
    args=(tests/test_triton_route.py)
  elif [[ -n ${SEL[$part]:-} ]]; then
    args=(tests/test_stack_gpu.py -k "${SEL[$part]}")
  else
    echo "gpu_tests.sh: no part '$part' (ffi kernels f32 bf16 rms decoder route outputs share causal norm split)"
    exit 2
  fi
  timeout "$TIMEOUT" python3 -m pytest -o addopts="" -v --tb=short -rP \
    -p no:warnings --durations=5 "${args[@]}" > "$OUT/gpu-tests-$part.txt" 2>&1
  rc=$?
  echo "== $part (rc $rc$([[ $rc == 124 ]] && echo ': cut by the timeout'))"
  grep -cE " PASSED" "$OUT/gpu-tests-$part.txt" | sed 's/^/   passed: /'
  grep -E " FAILED| ERROR|^(FAILED|ERROR) " "$OUT/gpu-tests-$part.txt" | head -5
  tail -1 "$OUT/gpu-tests-$part.txt"
done
