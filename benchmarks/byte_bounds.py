"""Byte arithmetic of routing at the presets: what bandwidth alone allows.

    python3 benchmarks/byte_bounds.py [--copy_tbs 4.2]

No GPU needed. For each preset's shape (benchmarks/stack_routing.SHAPES: one
microbatch of 32,768 tokens, D, n = 2L sublayers, bf16) and the baseline step
measured on the H200 (benchmarks/RESULTS.md, sessions 8-9), it prints:

* the routing bytes a step moves site by site (forward + backward,
  ``stack_routing.routing_bytes``), the time they take at the copy bandwidth,
  and so the best tokens/s ratio routing site by site can reach, against the
  issue's targets and the overhead each target allows;
* the full method's forward bytes routed two-phase in groups of G sites
  (``routed_stack(..., site_group=G)``) relative to site by site, counted in
  [B, T, D] arrays: phase 1 reads the group's old sources once and writes G
  results; each later site reads its new sources and its phase-1 result and
  writes its output;
* two memory / time side figures quoted in notes: the group buffer of G
  first-phase results, and one read of every source (the jnp inverse RMS).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from stack_routing import SHAPES, routing_bytes  # noqa: E402

# Baseline (prenorm) step ms and microbatches a step, one H200, from
# benchmarks/RESULTS.md: 100m and 350m session 8, 1b session 9 (run 3).
BASELINE = {"100m": (339.8, 4), "350m": (267.2, 1), "1b": (520.7, 1)}
TARGETS = {"100m": (0.95, 0.97), "350m": (0.92, 0.97), "1b": (0.90, 0.97)}


def two_phase_forward(sites: int, g: int) -> tuple[int, int]:
  """Forward arrays moved by the full method over ``sites`` sites: site by
  site, and two-phase in groups of ``g``."""
  per_site = sum(j + 2 for j in range(sites))         # read j+1, write 1
  grouped = 0
  for a in range(0, sites, g):
    b = min(a + g, sites)
    grouped += (a + 1) + (b - a)                       # old sources; results
    grouped += sum((j - a) + 2 for j in range(a + 1, b))   # new + init, out
  return per_site, grouped


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--copy_tbs", type=float, default=4.2,
                  help="copy bandwidth, TB/s (torch copy on the H200)")
  a = ap.parse_args()
  bw = a.copy_tbs * 1e12
  print("| preset | variant | GB/step | ms at 100% copy | best ratio |"
        " target | overhead the target allows, ms |")
  print("|---|---|---|---|---|---|---|")
  from mhar_jax.layers.router import block_boundaries
  for name, (tokens, d, n) in SHAPES.items():
    step_ms, micro = BASELINE[name]
    e = tokens * d * 2
    for (label, blocks), target in zip(
        (("full", list(range(n))), ("block8", block_boundaries(n, 8))),
        TARGETS[name]):
      gb = routing_bytes(n, blocks, e)[1] * micro
      ms = gb / bw * 1e3
      print(f"| {name} | {label} | {gb / 1e9:.0f} | {ms:.1f} |"
            f" {step_ms / (step_ms + ms):.3f} | {target} |"
            f" {step_ms * (1 / target - 1):.1f} |")
  print("\nfull method forward, two-phase / site by site (arrays moved):")
  for name, (tokens, d, n) in SHAPES.items():
    ratios = []
    for g in (4, 8, 12):
      per_site, grouped = two_phase_forward(n + 1, g)
      ratios.append(f"G={g}: {grouped}/{per_site} = {grouped / per_site:.2f}")
    print(f"  {name}: " + ", ".join(ratios))
  tokens, d, n = SHAPES["1b"]
  e = tokens * d * 2
  print(f"\n1b: group buffer of 8 first-phase results {8 * e / 1e9:.2f} GB;"
        f" one read of each of the {n + 1} sources {(n + 1) * e / bw * 1e3:.1f}"
        " ms at 100% copy")


if __name__ == "__main__":
  main()
