"""Where a routed model's extra time goes: routing across a whole stack, alone.

    python3 benchmarks/stack_routing.py --shapes 100m,1b [--json FILE]

For a preset's shape (one microbatch of ``tokens`` x ``D``, ``n = 2L``
sublayers, H = 8, bf16) it replaces every sublayer by a per-channel scale
(``y = x * p``: one read and one write, so the rest is routing) and times the
forward + backward (gradients of the embedding, every ``p``, every query and
gain), and the forward alone, of:

* ``prenorm``: ``x += f(x)`` (what the trivial sublayers cost without routing);
* ``full/site``: the full method, :func:`mhar_jax.kernels.route` at every
  site (one backward per site, what ``routing_backward="site"`` runs);
* ``full/source``: the full method as one
  :func:`mhar_jax.kernels.stack.routed_stack` (``routing_backward="source"``);
* ``block8/site``: Block MHAR with 8 blocks, ``route`` at every site;
* ``block8/source``: the same as one ``routed_stack(..., blocks=...)``;
* with ``--site_group G``: ``full/source-gG`` and ``block8/source-g``, the
  source variants routed two-phase (``routed_stack(..., site_group=G)``);

each with the Triton kernels and the jnp reference (XLA). Printed: ms per
microbatch, the routing's share (ms minus prenorm's), the bytes any routing
implementation must move (forward: every live source read and the output
written at every site; backward: the output cotangent and every source read,
every source gradient written), and those bytes per routing-second as a share
of a copy bandwidth measured in the same run (``x * c`` over 2 GiB).
It also counts copies of ``[n + 1, ...]`` arrays in each compiled HLO (a
whole-stack buffer XLA failed to update in place; other arrays of that
leading dim, such as stacked queries, count too, so compare with prenorm's).
Multiplying the routing ms by the preset's microbatches per step gives its
share of a training step (benchmarks/throughput.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mhar_jax import kernels  # noqa: E402
from mhar_jax.kernels.stack import routed_stack  # noqa: E402
from mhar_jax.layers.router import block_boundaries  # noqa: E402

# (microbatch tokens, D, sublayers): the presets at benchmarks/throughput.py's
# microbatch of 32768 tokens.
SHAPES = {"100m": (32768, 512, 24), "350m": (32768, 1024, 48),
          "1b": (32768, 1280, 72)}


def _scale(j, p, x, consts):
  del j, consts
  return x * p


def site_loop(h, ps, queries, gains, *, blocks, heads, impl):
  """The decoder's site-by-site routing (layers.Transformer._routed)."""
  done, partial = [h], None
  for j, p in enumerate(ps):
    sources = done if partial is None else done + [partial]
    y = _scale(j, p, kernels.route(sources, queries[j], gains[j],
                                   num_heads=heads, impl=impl), None)
    partial = y if partial is None else partial + y
    if j + 1 == len(ps) or blocks[j + 1] != blocks[j]:
      done.append(partial)
      partial = None
  return kernels.route(done, queries[-1], gains[-1], num_heads=heads,
                       impl=impl)


def source_stack(h, ps, queries, gains, *, heads, impl, blocks=None,
                 site_group=0):
  """The same routing as one ``routed_stack`` (source-major backward)."""
  return routed_stack(h, ps, _scale, queries, gains, None, num_heads=heads,
                      impl=impl, blocks=blocks, site_group=site_group)


def prenorm(h, ps, queries, gains):
  del queries, gains
  x = h
  for j, p in enumerate(ps):
    x = x + _scale(j, p, x, None)
  return x


def sources_read(n, blocks):
  """The sources each of the ``n + 1`` sites reads, given the ``n``
  sublayers' block indices: ``s_0``, the finished block sums and (after a
  block's first sublayer) its partial sum."""
  done, partial, counts = 1, False, []
  for j in range(n):
    counts.append(done + partial)
    partial = True
    if j + 1 == n or blocks[j + 1] != blocks[j]:
      done, partial = done + 1, False
  counts.append(done)
  return counts


def routing_bytes(n, blocks, e):
  """Minimum routing bytes (fwd, fwd+bwd) of one microbatch, ``e`` = one
  source's bytes: sum over sites of (S+1) e and (3S+2) e."""
  counts = sources_read(n, blocks)
  return (sum(s + 1 for s in counts) * e, sum(3 * s + 2 for s in counts) * e)


def stack_copies(compiled, rows):
  """The shapes of the whole-stack buffers (leading dim ``rows``) a compiled
  function's optimised HLO copies: an in-place buffer update that XLA could not
  keep in place shows up here (and costs the whole buffer per update)."""
  pat = re.compile(rf"= (\w+\[{rows},[^\]]*\])[^ ]* (copy|copy-start)\(")
  return [m.group(1) for m in map(pat.search, compiled.as_text().splitlines())
          if m]


def median_ms(fn, args, reps=9):
  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e3


def copy_bandwidth(mib=2048):
  x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
  f = jax.jit(lambda x: x * 1.0001)
  return 2 * x.nbytes / (median_ms(f, (x,)) / 1e3)


def run_shape(name, impls, heads, seed=0, only=None, site_group=0):
  tokens, d, n = SHAPES[name]
  rng = np.random.default_rng(seed)
  dt = jnp.bfloat16
  h = jnp.asarray(rng.normal(size=(tokens, d)), dt)
  ps = [jnp.asarray(1 + 0.01 * rng.normal(size=(d,)), dt) for _ in range(n)]
  queries = jnp.asarray(0.05 * rng.normal(size=(n + 1, d)), jnp.float32)
  gains = jnp.asarray(1 + 0.1 * rng.normal(size=(n + 1, d)), jnp.float32)
  ct = jnp.asarray(rng.normal(size=(tokens, d)), dt)

  def timed(f):
    def loss(h, ps, q, g):
      return jnp.sum((f(h, ps, q, g) * ct).astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))

  full, block8 = list(range(n)), block_boundaries(n, 8)
  variants = [("prenorm", "-", prenorm, None)]
  for impl in impls:
    src = functools.partial(source_stack, heads=heads, impl=impl)
    variants += [
        ("full/site", impl, functools.partial(site_loop, blocks=full,
                                              heads=heads, impl=impl), full),
        ("full/source", impl, src, full),
        ("block8/site", impl, functools.partial(site_loop, blocks=block8,
                                                heads=heads, impl=impl),
         block8),
        ("block8/source", impl, functools.partial(src, blocks=block8),
         block8),
    ]
    if site_group:
      variants += [
          (f"full/source-g{site_group}", impl,
           functools.partial(src, site_group=site_group), full),
          ("block8/source-g", impl,
           functools.partial(src, blocks=block8, site_group=site_group),
           block8),
      ]
  rows = []
  for label, impl, f, blocks in variants:
    if only and label != "prenorm" and label not in only:
      continue
    t0 = time.perf_counter()
    try:
      args = (h, ps, queries, gains)
      fn = timed(f).lower(*args).compile()
      copies = stack_copies(fn, n + 1)
      ms = median_ms(fn, args)
      fwd_ms = median_ms(jax.jit(f), args)
    except Exception as e:  # noqa: BLE001  (report and go on)
      print(f"{name} {label} {impl}: FAILED {type(e).__name__}: {e}"[:400],
            flush=True)
      continue
    row = {"shape": name, "tokens": tokens, "d": d, "sublayers": n,
           "variant": label, "impl": impl, "ms": ms, "fwd_ms": fwd_ms,
           "stack_copies": copies,
           "wall_s": time.perf_counter() - t0}
    if blocks is not None:
      row["fwd_bytes"], row["fwdbwd_bytes"] = routing_bytes(
          n, blocks, tokens * d * 2)
    rows.append(row)
    print(f"{name} {label} {impl}: {ms:.2f} ms (forward alone {fwd_ms:.2f}),"
          f" {len(copies)} whole-stack copies {copies}"
          f" (wall {row['wall_s']:.0f}s)",
          flush=True)
  return rows


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--shapes", default="100m,1b")
  ap.add_argument("--impls", default="triton,reference")
  ap.add_argument("--heads", type=int, default=8)
  ap.add_argument("--variants", default="",
                  help="comma list (e.g. full/source,block8/source); "
                  "default all; prenorm always runs")
  ap.add_argument("--source_grad_tuning", default="",
                  help="JSON dict merged into triton_stack.TUNING")
  ap.add_argument("--route_tuning", default="",
                  help="JSON dict merged into triton_route.TUNING (e.g. "
                  "'{\"fwd_given_r\": true}')")
  ap.add_argument("--site_group", type=int, default=0,
                  help="also time the source variants two-phase in groups "
                  "of this many sites (full/source-gG, block8/source-g: by "
                  "block)")
  ap.add_argument("--json", default="")
  a = ap.parse_args()
  if a.source_grad_tuning:
    from mhar_jax.kernels import triton_stack
    triton_stack.TUNING.update(json.loads(a.source_grad_tuning))
    print(f"triton_stack.TUNING = {triton_stack.TUNING}", flush=True)
  if a.route_tuning:
    from mhar_jax.kernels import triton_route
    triton_route.TUNING.update(json.loads(a.route_tuning))
    print(f"triton_route.TUNING = {triton_route.TUNING}", flush=True)
  bw = copy_bandwidth()
  print(f"{jax.devices()[0].device_kind}: copy bandwidth {bw / 1e12:.2f} TB/s",
        flush=True)
  rows = []
  for name in a.shapes.split(","):
    rows += run_shape(name, [i for i in a.impls.split(",") if i], a.heads,
                      only=[v for v in a.variants.split(",") if v],
                      site_group=a.site_group)
    if a.json:
      with open(a.json, "w") as f:
        json.dump({"copy_bytes_per_s": bw, "rows": rows}, f, indent=1)
  base = {r["shape"]: r["ms"] for r in rows if r["variant"] == "prenorm"}
  fwd_base = {r["shape"]: r["fwd_ms"] for r in rows
              if r["variant"] == "prenorm"}
  print("\n| shape | variant | impl | ms / microbatch | routing ms |"
        " of which forward | min routing GB (fwd+bwd) |"
        " min bytes / routing s, % of copy |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    extra = r["ms"] - base.get(r["shape"], 0.0)
    if "fwdbwd_bytes" in r:
      gb = r["fwdbwd_bytes"] / 1e9
      pct = f"{r['fwdbwd_bytes'] / (extra / 1e3) / bw:.0%}" if extra > 0 else "-"
    else:
      gb, pct = float("nan"), "-"
    fwd = r["fwd_ms"] - fwd_base.get(r["shape"], 0.0)
    print(f"| {r['shape']} | {r['variant']} | {r['impl']} | {r['ms']:.2f} |"
          f" {extra:.2f} | {fwd:.2f} | {gb:.2f} | {pct} |")


if __name__ == "__main__":
  main()
