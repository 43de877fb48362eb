"""Routing G sites at once on tensor cores against the per-site kernels.

    python3 benchmarks/depth_attention.py --sizes 32768x37 --sites 16
    python3 benchmarks/depth_attention.py --configs 16x1x3,16x1x3x16x1

Routing G sites over the same S sources is, per token and head, attention
with the G queries ``t_g`` (``[G, C]``) and the sources as keys and values
(``[S, C]``, the keys scaled by each source's inverse RMS per token)::

    logit[g, s] = r_s <t_g, x_s>      out[g] = softmax_s(logit) @ x

With G >= 16 both products are tensor-core matrix products (``tl.dot``), so
the instructions per byte fall far below the per-site kernels' (which issue
~4 fp32 multiply-adds an element a site on CUDA cores and are bound by
instruction issue: benchmarks/ROUTING_NOTES.md, session 11). This times the
library's kernel for it (``triton_stack.sites``, the first phase of
``routed_stack(..., site_group=G)``), in several tunings, against
``triton_route``'s G-site launch and G single-site launches on the same
inputs (all given the inverse RMS), each checked against the jnp reference
(on the first ``--check_tokens`` tokens: its fp32 copy of the sources is what
runs out of memory at S = 73).

Precision: the queries enter the first product as two bf16 terms (hi + lo,
~16 mantissa bits, like fp32 logits to ~1e-5); the weights enter the second
as two bf16 terms or one (as FlashAttention's; a config's fifth field, 1 or 0,
``SITES_TUNING["split_weights"]``, default 1), so outputs match the reference
to bf16 rounding, not fp32's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--sizes", default="32768x16,32768x37,32768x73")
  ap.add_argument("--d", type=int, default=1280)
  ap.add_argument("--h", type=int, default=8)
  ap.add_argument("--sites", type=int, default=16)
  ap.add_argument("--configs", default="16x1x3,16x2x3,32x1x3,16x1x4,16x1x2",
                  help="tokens a program x warps x pipeline stages [x "
                  "sources a block [x split weights, 0 or 1]] of "
                  "triton_stack.sites_kernel")
  ap.add_argument("--check_tokens", type=int, default=4096,
                  help="the jnp reference checks the first this many tokens"
                  " (its fp32 copy of all S rows needs 4 S N D bytes)")
  ap.add_argument("--json", default="")
  a = ap.parse_args()
  import jax
  import jax.numpy as jnp
  from mhar_jax.kernels import reference, stack, triton_route, triton_stack
  from routing import _median_ms, copy_bandwidth
  cb = copy_bandwidth()
  copy_gbs = max(v for v in cb.values() if isinstance(v, float))
  print(f"{jax.devices()[0].device_kind}: copy {copy_gbs:.0f} GB/s; D={a.d} "
        f"H={a.h} G={a.sites} bf16", flush=True)

  def errors(out, lse, want, want_lse, m):
    """(max |out - want| / max |want|, max |lse - want_lse|) over the first
    ``m`` tokens."""
    want = want.astype(jnp.float32)
    return (float(jnp.max(jnp.abs(out[:, :m].astype(jnp.float32) - want))
                  / jnp.max(jnp.abs(want))),
            float(jnp.max(jnp.abs(lse[:, :m] - want_lse))))

  rows = []
  default_block = triton_stack.SITES_TUNING["source_block"]
  default_split = triton_stack.SITES_TUNING["split_weights"]
  for size in a.sizes.split(","):
    n, s = map(int, size.split("x"))
    ks = jax.random.split(jax.random.key(s), 3)
    x = (jax.random.normal(ks[0], (s, n, a.d)) * 1.3).astype(jnp.bfloat16)
    # row by row: an fp32 copy of all S rows (4 S N D bytes) need not fit
    r = jax.lax.map(lambda v: reference.inv_rms(v, 1e-6), x)
    t = 0.5 * jax.random.normal(ks[1], (a.sites, a.d)) / (a.d / a.h) ** 0.5
    srcs = [x[i] for i in range(s)]
    rs = [r[i] for i in range(s)]
    plan = stack._Plan(a.h, 1e-6, "reference")
    m = min(n, a.check_tokens)
    with jax.default_matmul_precision("highest"):   # fp32, to compare with
      want, want_lse = jax.jit(lambda srcs, t, rs: stack._sites(
          [v[:m].astype(jnp.float32) for v in srcs],
          t.reshape(a.sites, a.h, -1), [v[:m] for v in rs], plan))(srcs, t, rs)
    cfg = triton_route._make_cfg(a.d, a.h, 1e-6, True, None, ())
    lib_g = jax.jit(lambda srcs, t, rs: triton_route._fwd_impl(
        tuple(srcs), t, cfg, rs=tuple(rs)))
    lib_1 = jax.jit(lambda srcs, t, rs: [triton_route._fwd_impl(
        tuple(srcs), t[k:k + 1], cfg, rs=tuple(rs)) for k in range(a.sites)])
    nbytes = (s + a.sites) * n * a.d * 2
    res = {}
    for name, fn, args in (
        ("library, G-site launch", lib_g, (srcs, t, rs)),
        ("library, G launches", lib_1, (srcs, t, rs))):
      ms, _, _ = _median_ms(fn, args)
      res[name] = ms
    for cfg_s in a.configs.split(","):
      parts = list(map(int, cfg_s.split("x")))
      bt, w, st = parts[:3]
      sb = parts[3] if len(parts) > 3 else default_block
      split = bool(parts[4]) if len(parts) > 4 else default_split
      triton_stack.SITES_TUNING.update(tokens_per_program=bt, warps=w,
                                       stages=st, source_block=sb,
                                       split_weights=split)
      fn = jax.jit(lambda x, r, t: triton_stack.sites_local(x, r, s, t, a.h))
      try:
        err, lerr = errors(*fn(x, r, t), want, want_lse, m)
        ms, _, _ = _median_ms(fn, (x, r, t))
      except Exception as ex:  # noqa: BLE001
        print(f"  {n}x{s} {cfg_s}: ERROR {ex!r}"[:400], flush=True)
        continue
      res[f"depth attention {cfg_s}"] = ms
      print(f"  {n}x{s} depth attention BTxWxSTAGES[xSB[xSPLIT]] {cfg_s}: "
            f"{ms:.3f} ms, "
            f"{100 * nbytes / (ms * 1e-3) / 1e9 / copy_gbs:.1f}% of copy "
            f"(S + G arrays), out rel err {err:.1e}, lse abs err {lerr:.1e}",
            flush=True)
    for k, v in res.items():
      print(f"{n}x{s} G={a.sites}: {k:28s} {v:8.3f} ms", flush=True)
    rows.append(dict(n=n, s=s, g=a.sites, ms=res))
  if a.json:
    with open(a.json, "w") as f:
      json.dump(dict(copy=cb, d=a.d, h=a.h, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
