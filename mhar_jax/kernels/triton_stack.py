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

``source_grad_kernel`` (backward): one launch per source ``i`` computes, for
every token, the gradient of ``s_i`` from all ``M = n + 1 - i`` sites that
read it (``stack.source_grad``, its jnp reference)::

    for k in 0 .. M-1 (site j = i + k):
      u      = <s_i, t_j>_h            logit = r_i u        w = exp(logit - lse_j)
      dlogit = w (<dx_j, s_i>_h - xd_j)
      acc   += w dx_j + (dlogit r_i) t_j          coef += dlogit logit
    ds_i = acc - (sum_h coef) r_i^2 / D * s_i

and writes ``dlogit * r_i`` (``[M, N, H]`` fp32) from which the query-gain
gradient ``dt_j += sum_n (dlogit r_i)[n, h] s_i[n, c]`` is one small einsum in
XLA (one more read of ``s_i``). Bytes per source: ``s_i`` once, each ``dx_j``
once, ``ds_i`` once.

Tiles follow :mod:`mhar_jax.kernels.triton_route`: a program owns ``BN`` whole
tokens viewed as ``[BN, HP, CP]`` (heads x channels padded to powers of two,
masked). Checked with Triton's interpreter on CPU (tests/test_triton_stack.py)
and on the GPU (tests/test_stack_gpu.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax_triton as jt
import triton
import triton.language as tl

from mhar_jax.kernels.triton_route import _cols, _pow2, _rows, _tokens_per_program

ELEMS_PER_THREAD = 16
WARPS = 4
STAGES = 2


@triton.jit
def source_grad_kernel(s_ptr, r_ptr, dx_ptr, t_ptr, lse_ptr, xd_ptr, I, M, N,
                       ds_ptr, dlr_ptr,
                       D: tl.constexpr, H: tl.constexpr, C: tl.constexpr,
                       HP: tl.constexpr, CP: tl.constexpr, BN: tl.constexpr,
                       STAGES: tl.constexpr):
  """One token tile of the gradient of one source from all its readers.

  ``s_ptr [R, N, D]`` (sources, source dtype) and ``r_ptr [R, N]`` fp32
  (their inverse RMS), row ``I`` used; ``dx_ptr [R, N, D]``
  (site cotangents), ``t_ptr [R, D]`` fp32, ``lse_ptr``/``xd_ptr [R, N, H]``
  fp32, rows ``I .. I+M-1`` used. Outputs ``ds_ptr [N, D]`` (source dtype) and
  ``dlr_ptr [M, N, H]`` fp32. Parameter order is jax-triton's: inputs, runtime
  scalars (not specialised: one compiled kernel serves every source), outputs,
  constexprs.
  """
  tile = tl.program_id(0)
  col, cmask = _cols(H, C, HP, CP)
  base, off, mask, hbase, hoff, hmask = _rows(tile, N, col, cmask, D, H, HP,
                                                 BN)
  rows = tile * BN + tl.arange(0, BN)
  nd = N.to(tl.int64) * D
  nh = N.to(tl.int64) * H
  x = tl.load(s_ptr + I.to(tl.int64) * nd + base + off, mask=mask,
              other=0.0).to(tl.float32)
  r = tl.load(r_ptr + I.to(tl.int64) * N + rows, mask=rows < N, other=0.0)
  acc = tl.zeros((BN, HP, CP), tl.float32)
  coef = tl.zeros((BN, HP), tl.float32)
  for k in tl.range(0, M, num_stages=STAGES):
    j = (I + k).to(tl.int64)
    dx = tl.load(dx_ptr + j * nd + base + off, mask=mask,
                 other=0.0).to(tl.float32)
    tk = tl.load(t_ptr + j * D + col, mask=cmask, other=0.0)
    lse = tl.load(lse_ptr + j * nh + hbase + hoff, mask=hmask, other=0.0)
    xd = tl.load(xd_ptr + j * nh + hbase + hoff, mask=hmask, other=0.0)
    u = tl.sum(x * tk[None, :, :], axis=2)
    logit = r[:, None] * u
    w = tl.exp(logit - lse)
    dl = w * (tl.sum(dx * x, axis=2) - xd)
    dlr = dl * r[:, None]
    acc += w[:, :, None] * dx + dlr[:, :, None] * tk[None, :, :]
    coef += dl * logit
    tl.store(dlr_ptr + k * nh + hbase + hoff, dlr, mask=hmask)
  scale = tl.sum(coef, axis=1) * r * r / D
  ds = acc - scale[:, None, None] * x
  tl.store(ds_ptr + base + off, ds.to(ds_ptr.dtype.element_ty), mask=mask)


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
    kp = KP.to(tl.int64)
    m = tl.load(plin_ptr + kp * nh + hbase + hoff, mask=hmask,
                other=0.0)[None, :, :]
    l = tl.full((GP, BN, HP), 1.0, tl.float32)
    acc = tl.load(pin_ptr + kp * nd + base + off, mask=mask,
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


# site_group_kernel: each thread holds about this many fp32 accumulator
# elements (G sites x BN tokens x padded width over the threads).
GROUP_ACC_PER_THREAD = 64
GROUP_WARPS = 8


def group_tokens_per_program(d: int, h: int, g: int) -> int:
  return _tokens_per_program(_pow2(g) * _pow2(h) * _pow2(d // h),
                             GROUP_ACC_PER_THREAD, GROUP_WARPS)


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
  bn = group_tokens_per_program(d, h, g)
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
      grid=(triton.cdiv(n, bn),), num_warps=GROUP_WARPS, num_stages=1,
      G=g, GP=_pow2(g), RESUME=resume is not None,
      D=d, H=h, C=c, HP=_pow2(h), CP=_pow2(c), BN=bn, STAGES=STAGES)
  if g == 1:
    pout = jnp.zeros((0, n, d), S.dtype)
    plse = jnp.zeros((0, n, h), jnp.float32)
  return out, lse, pout, plse


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


def tokens_per_program(d: int, h: int) -> int:
  return _tokens_per_program(_pow2(h) * _pow2(d // h), ELEMS_PER_THREAD, WARPS)


def source_grad_local(S, R, dX, t, lse, xd, i: int, h: int):
  """One source's gradient on local (unsharded) arrays.

  ``S [R, N, D]``, ``R [R, N]`` (sources and their inverse RMS; row ``i``),
  ``dX [R, N, D]``, ``t [R, D]``, ``lse``/``xd`` ``[R, N, H]``; sites
  ``i .. R-1`` read the source. Returns ``(ds [N, D], dt [R - i, D])`` with
  ``dt`` this source's share of the query-gain gradient of those sites.
  """
  _, n, d = S.shape
  m = dX.shape[0] - i
  c = d // h
  bn = tokens_per_program(d, h)
  ds, dlr = jt.triton_call(
      S, R, dX, t, lse, xd, i, m, n,
      kernel=source_grad_kernel,
      out_shape=[jax.ShapeDtypeStruct((n, d), S.dtype),
                 jax.ShapeDtypeStruct((m, n, h), jnp.float32)],
      grid=(triton.cdiv(n, bn),), num_warps=WARPS, num_stages=1,
      D=d, H=h, C=c, HP=_pow2(h), CP=_pow2(c), BN=bn, STAGES=STAGES)
  dt = jnp.einsum("mnh,nhc->mhc", dlr,
                  S[i].astype(jnp.float32).reshape(n, h, c)).reshape(m, d)
  return ds, dt


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


def source_grad(S, R, dX, t, lse, xd, i: int, h: int, mesh=None,
                batch_axes=()):
  """:func:`source_grad_local` on ``[R, tokens..., ...]`` buffers, under
  ``shard_map`` over the batch axes of ``mesh`` when given (``dt``
  psummed)."""
  from jax.sharding import PartitionSpec as P

  def local(S, R, dX, t, lse, xd):
    loc = S.shape[1:-1]
    d = S.shape[-1]
    ds, dt = source_grad_local(
        _flat_rows(S, d), _flat_rows(R), _flat_rows(dX, d), t,
        _flat_rows(lse, h), _flat_rows(xd, h), i, h)
    if mesh is not None and batch_axes:
      dt = jax.lax.psum(dt, batch_axes)
    return ds.reshape(*loc, d), dt

  if mesh is None:
    return local(S, R, dX, t, lse, xd)
  tok, row, rows = _specs(S.ndim - 2, batch_axes)
  return jax.shard_map(local, mesh=mesh,
                       in_specs=(rows, row, rows, P(), rows, rows),
                       out_specs=(tok, P()), check_vma=False)(
                           S, R, dX, t, lse, xd)
