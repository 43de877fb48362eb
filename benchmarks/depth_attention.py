"""Experiment: routing G sites at once on tensor cores ("depth attention").

    python3 benchmarks/depth_attention.py --sizes 32768x37 --sites 16

Routing G sites over the same S sources is, per token and head, attention
with the G queries ``t_g`` (``[G, C]``) and the sources as keys and values
(``[S, C]``, the keys scaled by each source's inverse RMS per token)::

    logit[g, s] = r_s <t_g, x_s>      out[g] = softmax_s(logit) @ x

With G >= 16 both products are tensor-core matrix products (``tl.dot``), so
the instructions per byte fall far below the per-site kernels' (which issue
~4 fp32 multiply-adds an element a site on CUDA cores and are bound by
instruction issue: benchmarks/ROUTING_NOTES.md, session 11). This file holds a
first such kernel (one head, a few tokens a program, sources in one
``[S, N, D]`` buffer) and times it against the library's kernels on the same
inputs: the G-site launch of ``triton_route`` and G single-site launches, all
given the inverse RMS. It is a measurement of whether routing groups of sites
on tensor cores pays, before the stack is rebuilt around it (sources in one
whole-stack buffer); it is not used by the library.

Precision: the queries enter the first product as two bf16 terms (hi + lo,
~16 mantissa bits, like fp32 logits to ~1e-5); the weights enter the second
in bf16 (as FlashAttention's), so outputs match the reference to bf16
rounding, not fp32's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))


@triton.jit
def _operand(x, LOWP: tl.constexpr):
  """A tensor-core operand: bf16 (LOWP) or fp32."""
  if LOWP:
    return x.to(tl.bfloat16)
  else:
    return x.to(tl.float32)


@triton.jit
def _split(t, LOWP: tl.constexpr):
  """fp32 ``t`` as ``(hi, lo)`` bf16 terms (LOWP; ~16 mantissa bits
  together) or ``(t, t)`` (the second unused)."""
  if LOWP:
    hi = t.to(tl.bfloat16)
    return hi, (t - hi.to(tl.float32)).to(tl.bfloat16)
  else:
    return t, t


@triton.jit
def _dot2(hi, lo, b, LOWP: tl.constexpr):
  """``(hi + lo) @ b`` (LOWP: two bf16 products), else ``hi @ b``."""
  if LOWP:
    return tl.dot(hi, b) + tl.dot(lo, b)
  else:
    return tl.dot(hi, b)


@triton.jit
def depth_attention_kernel(x_ptr, r_ptr, t_ptr, S, N, out_ptr, lse_ptr,
                           D: tl.constexpr, H: tl.constexpr, C: tl.constexpr,
                           CA: tl.constexpr, CB: tl.constexpr,
                           G: tl.constexpr, SB: tl.constexpr,
                           BT: tl.constexpr, STAGES: tl.constexpr,
                           LOWP: tl.constexpr):
  """G sites over S sources for head ``program_id(1)`` of BT tokens.

  ``x_ptr [S, N, D]`` (bf16), ``r_ptr [S, N]`` fp32 inverse RMS, ``t_ptr
  [G, D]`` fp32 queries * gains. Outputs ``out_ptr [G, N, D]`` (bf16) and
  ``lse_ptr [G, N, H]`` fp32. A head's C channels are two power-of-two parts
  ``[0, CA)`` and ``[CA, C)`` (CB lanes, masked; CB = 0: none), as in
  ``triton_route.head_parts``. Sources go SB at a time with an online softmax.
  LOWP: tensor-core operands in bf16 (queries as hi + lo); off, fp32 (for
  Triton's interpreter, whose bf16 products are wrong).
  """
  tile = tl.program_id(0)
  h = tl.program_id(1)
  g = tl.arange(0, G)
  ca = tl.arange(0, CA)
  ta = tl.load(t_ptr + g[:, None] * D + h * C + ca[None, :])
  ta_hi, ta_lo = _split(ta, LOWP)
  if CB > 0:
    cb = tl.arange(0, CB)
    cbm = cb < C - CA
    tb = tl.load(t_ptr + g[:, None] * D + h * C + CA + cb[None, :],
                 mask=cbm[None, :], other=0.0)
    tb_hi, tb_lo = _split(tb, LOWP)
  sb = tl.arange(0, SB)
  nd = N.to(tl.int64) * D
  for i in range(BT):
    n = tile * BT + i
    if n < N:
      row = n.to(tl.int64) * D + h * C
      m = tl.full((G,), float("-inf"), tl.float32)
      l = tl.zeros((G,), tl.float32)
      acca = tl.zeros((G, CA), tl.float32)
      if CB > 0:
        accb = tl.zeros((G, CB), tl.float32)
      for s0 in tl.range(0, S, SB, num_stages=STAGES):
        s = s0 + sb
        sm = s < S
        xoff = s.to(tl.int64)[:, None] * nd + row
        xa = _operand(tl.load(x_ptr + xoff + ca[None, :], mask=sm[:, None],
                              other=0.0), LOWP)
        u = _dot2(ta_hi, ta_lo, tl.trans(xa), LOWP)
        if CB > 0:
          xb = _operand(tl.load(x_ptr + xoff + CA + cb[None, :],
                                mask=sm[:, None] & cbm[None, :], other=0.0),
                        LOWP)
          u += _dot2(tb_hi, tb_lo, tl.trans(xb), LOWP)
        rs = tl.load(r_ptr + s.to(tl.int64) * N + n, mask=sm, other=0.0)
        logit = tl.where(sm[None, :], u * rs[None, :], float("-inf"))
        m_new = tl.maximum(m, tl.max(logit, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(logit - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        pb = _operand(p, LOWP)
        acca = acca * alpha[:, None] + tl.dot(pb, xa)
        if CB > 0:
          accb = accb * alpha[:, None] + tl.dot(pb, xb)
        m = m_new
      ooff = g.to(tl.int64)[:, None] * nd + row
      inv = 1.0 / l[:, None]
      tl.store(out_ptr + ooff + ca[None, :],
               (acca * inv).to(out_ptr.dtype.element_ty))
      if CB > 0:
        tl.store(out_ptr + ooff + CA + cb[None, :],
                 (accb * inv).to(out_ptr.dtype.element_ty), mask=cbm[None, :])
      tl.store(lse_ptr + (g.to(tl.int64) * N + n) * H + h, m + tl.log(l))


def depth_attention(x, r, t, num_heads: int, tokens_per_program: int = 4,
                    source_block: int = 16, num_warps: int = 4,
                    stages: int = 3):
  """``(out [G, N, D], lse [G, N, H])`` of G sites over the sources ``x``
  ``[S, N, D]`` (bf16) given their inverse RMS ``r [S, N]`` and the sites'
  ``t [G, D]`` (G a power of two >= 16, and both parts of a head's channels
  at least 16 lanes: ``tl.dot``'s minimum), through jax-triton."""
  import jax
  import jax.numpy as jnp
  import jax_triton as jt
  from mhar_jax.kernels.triton_route import head_parts
  s, n, d = x.shape
  g = t.shape[0]
  c = d // num_heads
  ca, cb = head_parts(c)
  return jt.triton_call(
      x, r.astype(jnp.float32), t.astype(jnp.float32), s, n,
      kernel=depth_attention_kernel,
      out_shape=[jax.ShapeDtypeStruct((g, n, d), x.dtype),
                 jax.ShapeDtypeStruct((g, n, num_heads), jnp.float32)],
      grid=(triton.cdiv(n, tokens_per_program), num_heads),
      num_warps=num_warps, num_stages=1, D=d, H=num_heads, C=c, CA=ca,
      CB=cb, G=g, SB=source_block, BT=tokens_per_program, STAGES=stages,
      LOWP=True)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--sizes", default="32768x16,32768x37,32768x73")
  ap.add_argument("--d", type=int, default=1280)
  ap.add_argument("--h", type=int, default=8)
  ap.add_argument("--sites", type=int, default=16)
  ap.add_argument("--configs", default="4x4x3,4x4x1,4x8x3,16x4x3",
                  help="tokens a program x warps x pipeline stages of the "
                  "new kernel")
  ap.add_argument("--json", default="")
  a = ap.parse_args()
  import jax
  import jax.numpy as jnp
  from mhar_jax.kernels import reference, stack, triton_route
  from routing import _median_ms, copy_bandwidth
  cb = copy_bandwidth()
  copy_gbs = max(v for v in cb.values() if isinstance(v, float))
  print(f"{jax.devices()[0].device_kind}: copy {copy_gbs:.0f} GB/s; D={a.d} "
        f"H={a.h} G={a.sites} bf16", flush=True)
  rows = []
  for size in a.sizes.split(","):
    n, s = map(int, size.split("x"))
    ks = jax.random.split(jax.random.key(s), 3)
    x = (jax.random.normal(ks[0], (s, n, a.d)) * 1.3).astype(jnp.bfloat16)
    r = reference.inv_rms(x, 1e-6)
    t = 0.5 * jax.random.normal(ks[1], (a.sites, a.d)) / (a.d / a.h) ** 0.5
    srcs = [x[i] for i in range(s)]
    rs = [r[i] for i in range(s)]
    plan = stack._Plan(a.h, 1e-6, "reference")
    want, want_lse = jax.jit(lambda srcs, t, rs: stack._sites(
        srcs, t.reshape(a.sites, a.h, -1), rs, plan))(srcs, t, rs)
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
      bt, w, st = map(int, cfg_s.split("x"))
      fn = jax.jit(lambda x, r, t, bt=bt, w=w, st=st: depth_attention(
          x, r, t, a.h, tokens_per_program=bt, num_warps=w, stages=st))
      try:
        out, lse = fn(x, r, t)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32)
                                    - want.astype(jnp.float32)))
                    / jnp.max(jnp.abs(want.astype(jnp.float32))))
        lerr = float(jnp.max(jnp.abs(lse - want_lse)))
        ms, _, _ = _median_ms(fn, (x, r, t))
      except Exception as ex:  # noqa: BLE001
        print(f"  {n}x{s} {cfg_s}: ERROR {ex!r}"[:400], flush=True)
        continue
      res[f"depth attention {cfg_s}"] = ms
      print(f"  {n}x{s} depth attention BTxWxSTAGES {cfg_s}: {ms:.3f} ms, "
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
