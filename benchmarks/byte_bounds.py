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
  first-phase results, and one read of every source (the jnp inverse RMS);
* the arrays the library's default moves (``--default``, :func:`default_arrays`:
  the presets' routing as built, part by part, in excess of the baseline's
  residual adds) and the best ratio they allow at the copy bandwidth against
  the latest H200 baselines (``LATEST``); ``--without`` leaves parts out,
  ``--source_bytes 1`` counts the routing's reads of the sources in 8 bits.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from stack_routing import SHAPES, routing_bytes, sources_read  # noqa: E402

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


# Baseline (prenorm) step ms on one H200 with the norm backward kernel's
# tree, benchmarks/RESULTS.md session 33 (100m: 4 microbatches; 350m, 1b: 1).
LATEST = {"100m": (307.6, 4), "350m": (249.9, 1), "1b": (491.9, 1)}
PARTS = ("forward routing", "inverse RMS", "buffer copies",
         "recomputed outputs", "sources' group shares", "per-source gradients",
         "query-gain reads", "block sums", "baseline residual")


def variants(name: str, n: int):
  """``(label, block index of each sublayer, tokens/s target)`` of the full
  method and Block MHAR-8 at preset ``name`` of ``n`` sublayers."""
  from mhar_jax.layers.router import block_boundaries
  full, block8 = TARGETS[name]
  return (("full", list(range(n)), full),
          ("block8", block_boundaries(n, 8), block8))


def default_arrays(n: int, blocks, share: float = 0.75, g: int = 16,
                   heads: int = 8, d: int = 1280,
                   source_bytes: float = 2.0) -> dict:
  """``[T, D]`` arrays one microbatch's routing moves as the library runs it
  on Triton (``routed_stack`` with its default site groups, the presets'
  ``recompute_site_outputs=share``), less the baseline's residual adds, by
  part. ``blocks``: each of the ``n`` sublayers' block index.

  Forward: each site group's first phase reads the sources before it once and
  writes the group's results; each later site of a group reads its group's
  new sources and its first-phase result and writes its output (blocks: every
  site reads its sources and writes its output); each new source is read
  once for its inverse RMS and copied once into the sources' buffer (full
  method: a read and a write). Backward: the sites below ``share * n``
  recompute their outputs (their group's sources read once, the outputs
  written); sources in groups of ``g`` from the top: the group's share of
  the sites above it (its sources and those sites' cotangents read, its sums
  written; ``dlogit r`` fp32 written and read back with the sources again
  for the query-gain gradient), then each source over its own group's sites
  (it, its share and those cotangents read, its gradient written, read again
  for its query-gain rows); blocks: each source over all its readers. The
  sites' norms (input and backward, ``<dx, x>`` with it) and the sublayers
  move what the baseline's do. Subtracted: the baseline's residual add, 2
  arrays a sublayer forward (the sublayer's output read, the sum written)
  and 1 backward (the sum's gradient read again).

  ``source_bytes``: the bytes of an element of a source as the routing reads
  it (2: bf16, as built; 1: an 8-bit copy). Each routing read of a source
  counts ``source_bytes / 2`` arrays; the full method's buffer copy writes
  that much; with fewer than 2, Block writes each source once more at that
  width (beside its inverse-RMS read, which stays). Everything else (results,
  outputs, cotangents, gradients) stays bf16 or fp32.
  """
  from mhar_jax.kernels.stack import _Plan
  plan = _Plan(heads, 1e-6, "triton", blocks=tuple(blocks), site_group=g,
               recompute_below=int(share * n + 0.5))
  ends = plan.block_ends(n)
  live = sources_read(n, plan.blocks)
  dlr = heads * 4 / (2 * d)          # fp32 per (source, site, head) / array
  f = source_bytes / 2               # one read of a source, in arrays
  parts = dict.fromkeys(PARTS, 0.0)
  below = plan.recomputed_sites(n)
  if plan.full:
    groups = plan.site_groups(n)
    for a, b in groups:
      parts["forward routing"] += (a + 1) * f + (b - a)
      parts["forward routing"] += sum((j - a) * f + 2
                                      for j in range(a + 1, b))
      if a < below:                         # recomputed, one pass a group
        top = min(b, below)
        parts["recomputed outputs"] += top * f + (top - a)
    parts["buffer copies"] = n * (1 + f)
    parts["inverse RMS"] = n + 1            # s_0 and every sublayer's output
    for b in range(n + 1, 0, -g):           # sources from the top
      a = max(0, b - g)
      m = n + 1 - b                         # sites above the group
      if m:
        parts["sources' group shares"] += ((b - a) * (f + 1) + m
                                           + (b - a) * m * dlr)
        parts["query-gain reads"] += (b - a) * (f + m * dlr)
      for i in range(a, b):                 # s_i, its share, own sites
        own = b - i
        parts["per-source gradients"] += f + bool(m) + own + 1 + own * dlr
        parts["query-gain reads"] += f + own * dlr
  else:
    parts["forward routing"] = sum(s * f + 1 for s in live)
    parts["recomputed outputs"] = sum(s * f + 1 for s in live[:below])
    # a block's running sum: each sublayer after its block's first adds its
    # output (2 read, 1 written), and the backward adds the sum's gradient
    # to the sublayer's the same way
    adds = sum(not ends[j - 1] for j in range(1, n))
    parts["block sums"] = 6 * adds
    # s_0, every block's sum and each partial sum (one a sublayer after its
    # block's first), each read once for its inverse RMS; each source read,
    # its gradient written and each (site, source) pair's cotangent read,
    # ``dlogit r`` written and read back with the source again
    sources, pairs = 1 + sum(ends) + adds, sum(live)
    parts["inverse RMS"] = sources
    parts["buffer copies"] = sources * f if f < 1 else 0
    parts["per-source gradients"] = sources * (f + 1) + pairs * (1 + dlr)
    parts["query-gain reads"] = sources * f + pairs * dlr
  parts["baseline residual"] = -3 * n
  return parts


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--copy_tbs", type=float, default=4.2,
                  help="copy bandwidth, TB/s (torch copy on the H200)")
  ap.add_argument("--default", action="store_true",
                  help="only the library's default, part by part")
  ap.add_argument("--share", type=float, default=0.75,
                  help="recompute_site_outputs of --default")
  ap.add_argument("--group", type=int, default=16,
                  help="--default: the full method's site (and source) group")
  ap.add_argument("--without", default="",
                  help="--default: parts left out (comma-separated names as"
                       " printed), what removing their bytes would allow")
  ap.add_argument("--source_bytes", type=float, default=2.0,
                  help="--default: bytes of a source element as the routing"
                       " reads it (2: bf16, as built; 1: 8-bit copies)")
  a = ap.parse_args()
  bw = a.copy_tbs * 1e12
  if a.default:
    print_default(bw, a.share, [p for p in a.without.split(",") if p],
                  a.group, a.source_bytes)
    return
  print("| preset | variant | GB/step | ms at 100% copy | best ratio |"
        " target | overhead the target allows, ms |")
  print("|---|---|---|---|---|---|---|")
  for name, (tokens, d, n) in SHAPES.items():
    step_ms, micro = BASELINE[name]
    e = tokens * d * 2
    for label, blocks, target in variants(name, n):
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


def print_default(bw: float, share: float, without=(), group: int = 16,
                  source_bytes: float = 2.0):
  """The default's arrays by part and the best ratio at ``bw`` bytes/s,
  the parts named in ``without`` left out, the full method's groups of
  ``group``, sources read at ``source_bytes`` bytes an element."""
  unknown = set(without) - set(PARTS)
  if unknown:
    raise SystemExit(f"--without: no part {sorted(unknown)}; the parts are"
                     f" {list(PARTS)}")
  rows = []
  for name, (tokens, d, n) in SHAPES.items():
    step_ms, micro = LATEST[name]
    e = tokens * d * 2 * micro
    for label, blocks, target in variants(name, n):
      parts = default_arrays(n, blocks, share, g=group, d=d,
                             source_bytes=source_bytes)
      parts = {k: 0.0 if k in without else v for k, v in parts.items()}
      ms = sum(parts.values()) * e / bw * 1e3
      rows.append((name, label, parts, ms, step_ms, target))
  names = list(PARTS)
  print(f"arrays a microbatch, recompute_site_outputs={share}, groups of"
        f" {group}, sources read at {source_bytes:g} bytes"
        + (f", without {', '.join(without)}" if without else "")
        + ":")
  print("| preset | variant | " + " | ".join(names) + " | total |")
  print("|---|---|" + "---|" * (len(names) + 1))
  for name, label, parts, *_ in rows:
    print(f"| {name} | {label} | " + " | ".join(
        f"{parts[k]:.0f}" for k in names) + f" | {sum(parts.values()):.0f} |")
  print(f"\nat {bw / 1e12:.2f} TB/s against the latest H200 baselines:")
  print("| preset | variant | ms a step | best ratio | target |"
        " overhead the target allows, ms |")
  print("|---|---|---|---|---|---|")
  for name, label, _, ms, step_ms, target in rows:
    print(f"| {name} | {label} | {ms:.1f} | {step_ms / (step_ms + ms):.3f} |"
          f" {target} | {step_ms * (1 / target - 1):.1f} |")


if __name__ == "__main__":
  main()
