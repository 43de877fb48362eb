#!/usr/bin/env bash
# The tensor-core routing kernels' tunings at the 1b shape
# (D 1280, H 8, bf16, 32,768 tokens), one H200 (device tool; carry .whl):
#   bash benchmarks/gpu_kernel_sweep.sh [tests|sites|sources|qgrad|grad|all]
# tests:   both kernels and the query-gain product against the jnp
#          references on the GPU (values, poisoned outputs, split cotangent
#          buffers): benchmarks/gpu_tests.sh kernels
# sites:   triton_stack.sites_kernel, G = 16 sites over 16 / 37 / 64 sources
#          (benchmarks/depth_attention.py; configs BT x warps x stages x SB),
#          each checked against the jnp reference first
# sources: triton_stack.sources_kernel, 16 sources' share of 16 sites (one
#          block a token: the split cotangent buffers) and of 48 (or
#          $SOURCES_MS), under SOURCES_TUNING variants (or the JSON list
#          $SOURCES_TUNINGS) (benchmarks/source_grad.py --group 16)
# qgrad:   triton_stack.query_gain_grad (the query-gain product) under
#          QGRAD_TUNING variants against XLA's einsum: one source's row with
#          16 sites, and 16 sources' rows with 32, 48 and 64 sites
#          (benchmarks/source_grad.py --qgrad)
# grad:    triton_stack.source_grad_kernel (one source's gradient from its
#          group's 1, 4, 8 or 16 sites continuing the share of the sites
#          above the group, with the query-gain product: the 1b grouped
#          backward's calls) under TUNING variants
#          (benchmarks/source_grad.py --init --ms 1,4,8,16)
# Raw output: $OUT/sweep-*.txt; the timing lines are printed.
set -uo pipefail
source benchmarks/gpu_env.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}
if [[ $what == tests || $what == all ]]; then
  OUT=$OUT bash benchmarks/gpu_tests.sh kernels
fi
if [[ $what == sites || $what == all ]]; then
  timeout 240 python3 benchmarks/depth_attention.py \
    --sizes 32768x16,32768x37,32768x64 --sites 16 \
    --configs 16x1x3,16x2x3,16x4x3,16x1x4,16x1x2,32x1x3,8x1x3 \
    > "$OUT/sweep-sites.txt" 2>&1
  echo "== sites (rc $?)"; grep -E "copy|depth attention|ERROR" "$OUT/sweep-sites.txt"
fi
if [[ $what == sources || $what == all ]]; then
  # SOURCES_TUNINGS (a JSON list) and SOURCES_MS (site counts) override
  TUNINGS=${SOURCES_TUNINGS:-'[{"warps": 4}, {"warps": 2}, {"warps": 8},
    {"stages": 2}, {"stages": 4}, {"tokens_per_program": 32},
    {"tokens_per_program": 8}, {"site_block": 32}, {"site_block": 32,
    "warps": 8}, {"site_block": 64, "warps": 8}]'}
  for m in ${SOURCES_MS:-16 48}; do
    timeout 180 python3 benchmarks/source_grad.py --group 16 --m $m \
      --tunings "$TUNINGS" > "$OUT/sweep-sources-m$m.txt" 2>&1
    echo "== sources, 16 x $m sites (rc $?)"
    grep -E "launches|sources_partial|ERROR" "$OUT/sweep-sources-m$m.txt"
  done
fi
if [[ $what == qgrad || $what == all ]]; then
  # QGRAD_SHAPES: warps x tokens a step to try (every site block); then
  # chunks of 256 and 512 tokens (more programs for one source's rows)
  TUNINGS=$(python3 -c 'import json, sys; print(json.dumps([{}] + [
    {f"sites{b}": wt for b in (16, 32, 64)} for wt in sys.argv[1].split()]
    + [{"chunk_tokens": 256}, {"chunk_tokens": 512}]))' \
    "${QGRAD_SHAPES:-2x32 2x64 4x32 4x64 4x128 8x32 8x64}")
  for args in "--m 16" "--group 16 --m 32" "--group 16 --m 48" \
      "--group 16 --m 64"; do
    name=sweep-qgrad-${args// /}
    timeout 150 python3 benchmarks/source_grad.py --qgrad $args \
      --tunings "$TUNINGS" --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
    echo "== query-gain product, $args (rc $?)"
    grep -E "XLA|query_gain_grad|ERROR" "$OUT/$name.txt"
  done
  # The fastest warps x tokens a step for each site block (one source's 16
  # sites: block 16; a group's 32: 32; 64: 64; at 1b the groups have 16, 32,
  # 48 and 64 sites above them) as throughput.py overrides, also left in
  # $QGRAD_BEST for a later call on the same machine.
  python3 - "$OUT" <<'PY' | tee "${QGRAD_BEST:-/tmp/qgrad_best}"
import json, sys
best = []
for name, mb in (("--m16", 16), ("--group16--m32", 32), ("--group16--m64", 64)):
  try:
    rows = json.load(open(f"{sys.argv[1]}/sweep-qgrad-{name}.json"))["rows"]
  except OSError:
    continue
  rows = [r for r in rows if r["what"] == "query_gain_grad"]
  # among the rows that differ from the defaults (the first) in sitesNN only
  same = lambda a, b: all(a[k] == b[k] for k in a if not k.startswith("sites"))
  rows = [r for r in rows if same(r["tuning"], rows[0]["tuning"])]
  if rows:
    fast = min(rows, key=lambda r: r["ms"])
    best += [f"kernels.query_gain.sites{mb}={fast['tuning'][f'sites{mb}']}"]
print("+".join(best))
PY
fi
if [[ $what == grad || $what == all ]]; then
  TUNINGS='[{}, {"elems_per_thread": 12}, {"elems_per_thread": 48},
    {"warps": 8}, {"warps": 2}, {"stages": 4}, {"stages": 5},
    {"stages": 4, "elems_per_thread": 48}]'
  timeout 300 python3 benchmarks/source_grad.py --init --ms 1,4,8,16 \
    --tunings "$TUNINGS" > "$OUT/sweep-grad.txt" 2>&1
  echo "== source gradient, 1 / 4 / 8 / 16 sites and a share (rc $?)"
  grep -E "tokens|source_grad|ERROR|copy" "$OUT/sweep-grad.txt"
fi
