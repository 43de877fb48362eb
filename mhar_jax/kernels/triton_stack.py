"""Triton kernels of :mod:`mhar_jax.kernels.stack`, the fully routed stack (GPU only).

Both read whole-stack buffers (``S [n+1, N, D]`` sources, ``R [n+1, N]``
their inverse RMS, and in the backward ``dX [n+1, N, D]`` site cotangents,
``lse``/``xd [n+1, N, H]``, ``t [n+1, D]``) at runtime row offsets, so each
has a runtime loop, compiles once for every call site, and never slices
(copies) a buffer.

``site_group_kernel`` (forward): one pass over sources ``I0 .. I0+NS-1``
serving ``G`` sites at once (``stack.site_group``, its jnp reference): per
site an online softmax per head (running max ``m``, sum ``l``, fp32
accumulator), with ``r`` read, not recomputed. It writes site 0's output and
log-sum-exp and the other sites' normalised partial results, from which a
later launch (``RESUME``, G = 1) continues over the sources that appeared
since. Bytes: each source read once per launch, ``G`` outputs written.

``source_group_grad_kernel`` (backward, source-major): one pass over the
site rows ``J0 ..`` computes, for every token, the gradient contributions to
``G`` sources at once (``stack.source_group_grad``, its jnp reference)::

    for each row j, each source i of the group:
      u      = <s_i, t_j>_h            logit = r_i u        w = exp(logit - lse_j)
      dlogit = w (<dx_j, s_i>_h - xd_j)
      acc_i += w dx_j + (dlogit r_i) t_j          coef_i += dlogit logit
    ds_i = acc_i - (sum_h coef_i) r_i^2 / D * s_i     (once all rows are in)

The group's top source is complete after the pass; the others store
``(acc_i, coef_i)`` and a later launch (``RESUME``, G = 1) adds the rows
that their own sublayers' backward produced since. It writes ``dlogit * r_i``
(``[G, M, N, H]`` fp32) from which the query-gain gradient ``dt_j += sum_n
(dlogit r_i)[n, h] s_i[n, c]`` is one small einsum in XLA (one more read of
each source). Bytes per pass: each row ``dx_j`` once for all G sources.

Tiles follow :mod:`mhar_jax.kernels.triton_route`: a program owns ``BN`` whole
tokens viewed as ``[BN, HP, CP]`` (heads x channels padded to powers of two,
masked). Checked with Triton's interpreter on CPU (tests/test_triton_stack.py)
and on the GPU (tests/test_stack_gpu.py).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import jax_triton as jt
import triton
import triton.language as tl

from mhar_jax.kernels.triton_route import _cols, _pow2, _rows, _tokens_per_program



@triton.jit
def site_group_kernel(s_ptr, r_ptr, t_ptr, pin_ptr, plin_ptr, I0, NS, KP, N,
                      out_ptr, lse_ptr, pout_ptr, plse_ptr,
                      G: tl.constexpr, GP: tl.constexpr, RESUME: tl.constexpr,
                      D: tl.constexpr, H: tl.constexpr, C: tl.constexpr,
                      HP: tl.constexpr, CP: tl.constexpr, BN: tl.constexpr,
                      STAGES: tl.constexpr):
  """One token tile of ``G`` sites' online softmax over sources ``I0 ..
  I0+NS-1``.

  ``s_ptr [R, N, D]`` (source dtype), ``r_ptr [R, N]`` fp32 (inverse RMS),
  ``t_ptr [G, D]`` fp32 (query * gain per site). RESUME (G = 1): the state
  starts from row ``KP`` of ``pin_ptr [K, N, D]`` / ``plin_ptr [K, N, H]`` (a
  normalised partial output and its log-sum-exp: ``m = lse, l = 1, acc =
  out``). Outputs: site 0's ``out_ptr [N, D]`` and ``lse_ptr [N, H]``; sites
  ``1 .. G-1`` into ``pout_ptr [G-1, N, D]`` / ``plse_ptr [G-1, N, H]``
  (1-element dummies when G = 1). Tiles are ``[GP, BN, HP, CP]`` (sites,
  tokens, heads, channels; padded to powers of two and masked).
  """
  tile = tl.program_id(0)
  col, cmask = _cols(H, C, HP, CP)
  base, off, mask, hbase, hoff, hmask = _rows(tile, N, col, cmask, D, H, HP,
                                                 BN)
  rows = tile * BN + tl.arange(0, BN)
  nd = N.to(tl.int64) * D
  nh = N.to(tl.int64) * H
  g = tl.arange(0, GP)
  gmask = g < G
  t = tl.load(t_ptr + g[:, None, None] * D + col[None, :, :],
              mask=gmask[:, None, None] & cmask[None, :, :], other=0.0)
  t = t[:, None, :, :]                                    # [GP, 1, HP, CP]
  if RESUME:
    # KP may arrive as a Python int (Triton specialises 0 and 1)
    m = tl.load(plin_ptr + nh * KP + hbase + hoff, mask=hmask,
                other=0.0)[None, :, :]
    l = tl.full((GP, BN, HP), 1.0, tl.float32)
    acc = tl.load(pin_ptr + nd * KP + base + off, mask=mask,
                  other=0.0).to(tl.float32)[None, :, :, :]
  else:
    m = tl.full((GP, BN, HP), float("-inf"), tl.float32)
    l = tl.zeros((GP, BN, HP), tl.float32)
    acc = tl.zeros((GP, BN, HP, CP), tl.float32)
  for k in tl.range(0, NS, num_stages=STAGES):
    i = (I0 + k).to(tl.int64)
    x = tl.load(s_ptr + i * nd + base + off, mask=mask,
                other=0.0).to(tl.float32)
    r = tl.load(r_ptr + i * N + rows, mask=rows < N, other=0.0)
    u = tl.sum(x[None, :, :, :] * t, axis=3)              # [GP, BN, HP]
    logit = r[None, :, None] * u
    m_new = tl.maximum(m, logit)
    alpha = tl.exp(m - m_new)
    p = tl.exp(logit - m_new)
    l = l * alpha + p
    acc = acc * alpha[:, :, :, None] + p[:, :, :, None] * x[None, :, :, :]
    m = m_new
  out = (acc / l[:, :, :, None]).to(out_ptr.dtype.element_ty)
  lse = m + tl.log(l)
  g64 = g.to(tl.int64)
  o4 = g64[:, None, None, None] * nd + base + off[None, :, :, :]
  m4 = gmask[:, None, None, None] & mask[None, :, :, :]
  h4 = g64[:, None, None] * nh + hbase + hoff[None, :, :]
  hm4 = gmask[:, None, None] & hmask[None, :, :]
  first = g == 0
  tl.store(out_ptr + o4, out, mask=m4 & first[:, None, None, None])
  tl.store(lse_ptr + h4, lse, mask=hm4 & first[:, None, None])
  if G > 1:
    rest = g >= 1
    tl.store(pout_ptr + (o4 - nd), out, mask=m4 & rest[:, None, None, None])
    tl.store(plse_ptr + (h4 - nh), lse, mask=hm4 & rest[:, None, None])


@triton.jit
def source_group_grad_kernel(s_ptr, r_ptr, dx_ptr, t_ptr, lse_ptr, xd_ptr,
                             pain_ptr, pcin_ptr, SI, J0, M, KP, N,
                             ds_ptr, pacc_ptr, pcoef_ptr, dlr_ptr,
                             G: tl.constexpr, GP: tl.constexpr,
                             RESUME: tl.constexpr,
                             D: tl.constexpr, H: tl.constexpr,
                             C: tl.constexpr, HP: tl.constexpr,
                             CP: tl.constexpr, BN: tl.constexpr,
                             STAGES: tl.constexpr):
  """One token tile of the gradients of sources ``SI, SI-1, .., SI-G+1``
  from site rows ``J0 .. J0+M-1`` (``stack.source_group_grad``).

  ``s_ptr [R, N, D]``, ``r_ptr [R, N]``, ``dx_ptr [R, N, D]``, ``t_ptr [R,
  D]``, ``lse_ptr``/``xd_ptr [R, N, H]``. RESUME (G = 1): the sums start
  from row ``KP`` of ``pain_ptr [K, N, D]`` / ``pcin_ptr [K, N, H]``.
  Outputs: source ``SI``'s ``ds_ptr [N, D]``; the other sources' partial
  sums into ``pacc_ptr [G-1, N, D]`` (source dtype) / ``pcoef_ptr [G-1, N,
  H]`` (1-element dummies when G = 1); ``dlr_ptr [G, M, N, H]`` = dlogit r.
  """
  tile = tl.program_id(0)
  col, cmask = _cols(H, C, HP, CP)
  base, off, mask, hbase, hoff, hmask = _rows(tile, N, col, cmask, D, H, HP,
                                                 BN)
  rows = tile * BN + tl.arange(0, BN)
  nd = N.to(tl.int64) * D
  nh = N.to(tl.int64) * H
  g = tl.arange(0, GP)
  gmask = g < G
  g64 = g.to(tl.int64)
  src = (SI - g).to(tl.int64)                             # [GP] source rows
  m4 = gmask[:, None, None, None] & mask[None, :, :, :]
  x = tl.load(s_ptr + src[:, None, None, None] * nd + base + off[None],
              mask=m4, other=0.0).to(tl.float32)          # [GP, BN, HP, CP]
  r = tl.load(r_ptr + src[:, None] * N + rows[None, :],
              mask=gmask[:, None] & (rows < N)[None, :], other=0.0)
  r = r[:, :, None]                                       # [GP, BN, 1]
  if RESUME:
    acc = tl.load(pain_ptr + nd * KP + base + off, mask=mask,
                  other=0.0).to(tl.float32)[None, :, :, :]
    coef = tl.load(pcin_ptr + nh * KP + hbase + hoff, mask=hmask,
                   other=0.0)[None, :, :]
  else:
    acc = tl.zeros((GP, BN, HP, CP), tl.float32)
    coef = tl.zeros((GP, BN, HP), tl.float32)
  hm4 = gmask[:, None, None] & hmask[None, :, :]
  dlr_rows = g64[:, None, None] * M * nh + hbase + hoff[None, :, :]
  for k in tl.range(0, M, num_stages=STAGES):
    j = (J0 + k).to(tl.int64)
    dx = tl.load(dx_ptr + j * nd + base + off, mask=mask,
                 other=0.0).to(tl.float32)[None, :, :, :]
    tk = tl.load(t_ptr + j * D + col, mask=cmask, other=0.0)[None, None]
    lse = tl.load(lse_ptr + j * nh + hbase + hoff, mask=hmask,
                  other=0.0)[None, :, :]
    xd = tl.load(xd_ptr + j * nh + hbase + hoff, mask=hmask,
                 other=0.0)[None, :, :]
    logit = r * tl.sum(x * tk, axis=3)                    # [GP, BN, HP]
    w = tl.exp(logit - lse)
    dl = w * (tl.sum(dx * x, axis=3) - xd)
    dlr = dl * r
    acc += w[:, :, :, None] * dx + dlr[:, :, :, None] * tk
    coef += dl * logit
    tl.store(dlr_ptr + dlr_rows + k * nh, dlr, mask=hm4)
  scale = tl.sum(coef, axis=2)[:, :, None, None] * r[:, :, :, None] * \
      r[:, :, :, None] / D
  ds = acc - scale * x
  o4 = g64[:, None, None, None] * nd + base + off[None, :, :, :]
  first = (g == 0)[:, None, None, None]
  tl.store(ds_ptr + o4, ds.to(ds_ptr.dtype.element_ty), mask=m4 & first)
  if G > 1:
    rest = g >= 1
    tl.store(pacc_ptr + (o4 - nd), acc.to(pacc_ptr.dtype.element_ty),
             mask=m4 & rest[:, None, None, None])
    h4 = g64[:, None, None] * nh + hbase + hoff[None, :, :]
    tl.store(pcoef_ptr + (h4 - nh), coef, mask=hm4 & rest[:, None, None])


# Tiles: a program's BN tokens are chosen so that each thread holds at most
# `*_row` fp32 elements of one [BN, width] tile (width = padded D) and at most
# `*_acc` of the G-wide tiles (forward: G accumulators; backward: G sources
# and G accumulators), with `*_warps_small` warps for small groups (forward
# G <= 4, backward G <= 2) and `*_warps_large` above. `stages`: software
# pipelining depth of the runtime row loops. Override for a sweep with
# MHAR_STACK_TUNING='{"fwd_acc": 32}' (read at import).
TUNING: dict = {"fwd_row": 16, "fwd_acc": 64, "fwd_warps_small": 4,
                "fwd_warps_large": 8, "bwd_row": 16, "bwd_acc": 64,
                "bwd_warps_small": 4, "bwd_warps_large": 8, "stages": 2}
TUNING.update(json.loads(os.environ.get("MHAR_STACK_TUNING", "") or "{}"))


def _tile(width: int, tiles: int, row: int, acc: int, warps: int) -> int:
  """Tokens per program: a power of two in [1, 64] within both budgets."""
  return min(_tokens_per_program(width, row, warps),
             _tokens_per_program(tiles * width, acc, warps))


def _width(d: int, h: int) -> int:
  return _pow2(h) * _pow2(d // h)


def site_group_launch(d: int, h: int, g: int) -> tuple[int, int]:
  """``(tokens per program, warps)`` of :func:`site_group_kernel`."""
  tu = TUNING
  warps = tu["fwd_warps_small"] if g <= 4 else tu["fwd_warps_large"]
  return _tile(_width(d, h), _pow2(g), tu["fwd_row"], tu["fwd_acc"],
               warps), warps


def source_group_grad_launch(d: int, h: int, g: int) -> tuple[int, int]:
  """``(tokens per program, warps)`` of :func:`source_group_grad_kernel`."""
  tu = TUNING
  warps = tu["bwd_warps_small"] if g <= 2 else tu["bwd_warps_large"]
  return _tile(_width(d, h), 2 * _pow2(g), tu["bwd_row"], tu["bwd_acc"],
               warps), warps


def site_group_local(S, R, t, i0: int, ns: int, resume, h: int):
  """:func:`mhar_jax.kernels.stack.site_group` on local ``[R, N, ...]``
  buffers (``S [R, N, D]``, ``R [R, N]``, ``t [G, D]``; ``resume`` rows
  ``[K, N, D]`` / ``[K, N, H]``)."""
  _, n, d = S.shape
  g = t.shape[0]
  c = d // h
  if resume is not None and g != 1:
    raise ValueError(f"site_group: resuming serves one site, got {g}.")
  pin, plin, kp = resume if resume is not None else (t, t, 0)
  bn, warps = site_group_launch(d, h, g)
  one = jax.ShapeDtypeStruct((1,), jnp.float32)
  out, lse, pout, plse = jt.triton_call(
      S, R, t, pin, plin, i0, ns, kp, n,
      kernel=site_group_kernel,
      out_shape=[jax.ShapeDtypeStruct((n, d), S.dtype),
                 jax.ShapeDtypeStruct((n, h), jnp.float32),
                 jax.ShapeDtypeStruct((g - 1, n, d), S.dtype) if g > 1
                 else one,
                 jax.ShapeDtypeStruct((g - 1, n, h), jnp.float32) if g > 1
                 else one],
      grid=(triton.cdiv(n, bn),), num_warps=warps, num_stages=1,
      G=g, GP=_pow2(g), RESUME=resume is not None,
      D=d, H=h, C=c, HP=_pow2(h), CP=_pow2(c), BN=bn,
      STAGES=TUNING["stages"])
  if g == 1:
    pout = jnp.zeros((0, n, d), S.dtype)
    plse = jnp.zeros((0, n, h), jnp.float32)
  return out, lse, pout, plse


def max_grad_group(d: int, h: int) -> int:
  """Largest power-of-two group whose ``2 G`` one-token tiles fit the
  backward's register budget (16 at D = 512, 8 at 1024, 4 at 1280)."""
  tu = TUNING
  budget = tu["bwd_acc"] * 32 * tu["bwd_warps_large"]
  g = max(1, budget // (2 * _width(d, h)))
  return 1 << (g.bit_length() - 1)


def source_group_grad_local(S, R, dX, t, lse, xd, si: int, g: int, j0: int,
                            m: int, resume, h: int):
  """:func:`mhar_jax.kernels.stack.source_group_grad` on local ``[R, N,
  ...]`` buffers."""
  _, n, d = S.shape
  c = d // h
  if resume is not None and g != 1:
    raise ValueError(f"source_group_grad: resuming serves one source, got {g}.")
  pain, pcin, kp = resume if resume is not None else (t, t, 0)
  bn, warps = source_group_grad_launch(d, h, g)
  one = jax.ShapeDtypeStruct((1,), jnp.float32)
  ds, pacc, pcoef, dlr = jt.triton_call(
      S, R, dX, t, lse, xd, pain, pcin, si, j0, m, kp, n,
      kernel=source_group_grad_kernel,
      out_shape=[jax.ShapeDtypeStruct((n, d), S.dtype),
                 jax.ShapeDtypeStruct((g - 1, n, d), S.dtype) if g > 1
                 else one,
                 jax.ShapeDtypeStruct((g - 1, n, h), jnp.float32) if g > 1
                 else one,
                 jax.ShapeDtypeStruct((g, m, n, h), jnp.float32)],
      grid=(triton.cdiv(n, bn),), num_warps=warps, num_stages=1,
      G=g, GP=_pow2(g), RESUME=resume is not None,
      D=d, H=h, C=c, HP=_pow2(h), CP=_pow2(c), BN=bn,
      STAGES=TUNING["stages"])
  if g == 1:
    pacc = jnp.zeros((0, n, d), S.dtype)
    pcoef = jnp.zeros((0, n, h), jnp.float32)
  # dt[q, k] = sum_n dlr[q, k, n, h] s_{si-q}[n, c]: one read of the sources
  srcs = jax.lax.slice_in_dim(S, si - g + 1, si + 1)[::-1]
  dt = jnp.einsum("qknh,qnhc->qkhc", dlr,
                  srcs.astype(jnp.float32).reshape(g, n, h, c))
  return ds, pacc, pcoef, dt.reshape(g, m, d)


def source_group_grad(S, R, dX, t, lse, xd, si: int, g: int, j0: int, m: int,
                      resume, h: int, mesh=None, batch_axes=()):
  """:func:`source_group_grad_local` on ``[R, tokens..., ...]`` buffers,
  under ``shard_map`` over the batch axes of ``mesh`` when given (``dt``
  psummed). Same interface as :func:`mhar_jax.kernels.stack.source_group_grad`."""
  from jax.sharding import PartitionSpec as P

  def local(S, R, dX, t, lse, xd, *partial):
    loc = S.shape[1:-1]
    d = S.shape[-1]
    res = None
    if partial:
      res = (_flat_rows(partial[0], d), _flat_rows(partial[1], h), resume[2])
    ds, pacc, pcoef, dt = source_group_grad_local(
        _flat_rows(S, d), _flat_rows(R), _flat_rows(dX, d), t,
        _flat_rows(lse, h), _flat_rows(xd, h), si, g, j0, m, res, h)
    if mesh is not None and batch_axes:
      dt = jax.lax.psum(dt, batch_axes)
    return (ds.reshape(*loc, d), pacc.reshape(g - 1, *loc, d),
            pcoef.reshape(g - 1, *loc, h), dt)

  partial = () if resume is None else tuple(resume[:2])
  if mesh is None:
    return local(S, R, dX, t, lse, xd, *partial)
  tok, row, rows = _specs(S.ndim - 2, batch_axes)
  return jax.shard_map(local, mesh=mesh,
                       in_specs=(rows, row, rows, P(), rows, rows)
                       + (rows,) * len(partial),
                       out_specs=(tok, rows, rows, P()), check_vma=False)(
                           S, R, dX, t, lse, xd, *partial)


def site_group(S, R, t, i0: int, ns: int, resume, h: int, mesh=None,
               batch_axes=()):
  """:func:`site_group_local` on ``[R, tokens..., ...]`` buffers, under
  ``shard_map`` over the batch axes of ``mesh`` when given. Same interface
  and outputs as :func:`mhar_jax.kernels.stack.site_group`."""
  from jax.sharding import PartitionSpec as P
  g = t.shape[0]

  def local(S, R, t, *partial):
    loc = S.shape[1:-1]
    d = S.shape[-1]
    res = None
    if partial:
      res = (_flat_rows(partial[0], d), _flat_rows(partial[1], h), resume[2])
    out, lse, pout, plse = site_group_local(_flat_rows(S, d), _flat_rows(R),
                                            t, i0, ns, res, h)
    return (out.reshape(*loc, d), lse.reshape(*loc, h),
            pout.reshape(g - 1, *loc, d), plse.reshape(g - 1, *loc, h))

  partial = () if resume is None else tuple(resume[:2])
  if mesh is None:
    return local(S, R, t, *partial)
  tok, row, rows = _specs(S.ndim - 2, batch_axes)
  return jax.shard_map(local, mesh=mesh,
                       in_specs=(rows, row, P()) + (rows,) * len(partial),
                       out_specs=(tok, tok, rows, rows), check_vma=False)(
                           S, R, t, *partial)


def _specs(ndim_tokens: int, batch_axes):
  """PartitionSpecs ``(tok [tokens..., D], row [R, tokens...], rows [R,
  tokens..., D or H])`` with the first token dim over ``batch_axes``."""
  from jax.sharding import PartitionSpec as P
  first = (batch_axes if len(batch_axes) > 1 else batch_axes[0]) \
      if batch_axes else None
  rest = [None] * (ndim_tokens - 1)
  return (P(first, *rest, None), P(None, first, *rest),
          P(None, first, *rest, None))


def _flat_rows(x, last=None):
  """``[R, tokens..., last]`` -> ``[R, N, last]`` (or ``[R, N]``)."""
  return x.reshape(x.shape[0], -1) if last is None else x.reshape(
      x.shape[0], -1, last)
