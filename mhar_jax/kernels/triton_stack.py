"""Triton kernels of :mod:`mhar_jax.kernels.stack`'s whole-stack routing (GPU only).

* ``source_grad_kernel``: one source's gradient from all the sites that read
  it (the source-major backward; below).
* ``sites_kernel``: G sites routed at once over the same sources on tensor
  cores (the first phase of ``routed_stack(..., site_group=G)``).
* ``sources_kernel``: the share of the sites above a group of G sources in
  their gradients, at once on tensor cores (the grouped backward's first
  phase; ``source_grad_kernel`` with ``INIT`` then adds each source's own
  group's sites).
* ``query_gain_grad_kernel``: the query-gain gradient's product over the
  token rows of a buffer, for both of the above.

One launch per source ``i`` computes, for every token, the gradient of ``s_i``
from all ``M = n + 1 - i`` sites that read it (``stack.source_grad``, its jnp reference)::

    for k in 0 .. M-1 (site j = i + k):
      u      = <s_i, t_j>_h            logit = r_i u        w = exp(logit - lse_j)
      dlogit = w (<dx_j, s_i>_h - xd_j)
      acc   += w dx_j + (dlogit r_i) t_j          coef += dlogit logit
    ds_i = acc - (sum_h coef) r_i^2 / D * s_i

and writes ``dlogit * r_i`` (``[M, H, N]`` fp32) from which the query-gain
gradient ``dt_j += sum_n (dlogit r_i)[n, h] s_i[n, c]`` is one small product
(``query_gain_grad``: one more read of ``s_i``). The sources, the site
cotangents, statistics and queries live in buffers (``dX [n+1, N, D]``,
``lse``/``xd [n+1, N, H]``, ``t [n+1, D]``) that every kernel reads at a row
offset, so the kernel has a runtime loop over sites, compiles once for every
source, and nothing slices a buffer (XLA copies a row sliced out of a buffer
the backward updates in place: 34 GiB a microbatch at 1b before the kernels
took rows; ``benchmarks/hlo_copies.py``). Bytes per source: ``s_i`` once,
each ``dx_j`` once, ``ds_i`` once.

Tiles follow :mod:`mhar_jax.kernels.triton_route`: a program owns ``BN`` whole
tokens, each row viewed as two power-of-two parts per head, ``[HP, CA]`` and
``[HP, CB]`` (``triton_route.head_parts``; 160 channels = 128 + 32). Checked
against the reference with Triton's interpreter on CPU
(tests/test_triton_stack.py) and built on the GPU (tests/test_stack_gpu.py).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from mhar_jax.kernels import triton_route as tr
from mhar_jax.kernels.triton_route import (_cols, _hsum, _load, _rows, _store,
                                           _token_ids, _tokens_per_program,
                                           _zeros, head_parts, tile_meta,
                                           tile_width)

# Tokens per program are chosen so each thread holds about `elems_per_thread`
# fp32 elements of a tile; `stages`: software-pipelining depth of the loop
# over sites (the site cotangent tiles go through shared memory by async copy,
# so a deeper pipeline keeps more bytes in flight without more registers).
# 24 gives 2 tokens a program at D = 1280 and D = 1024, 4 at D = 512 (H = 8).
# On the H200 (benchmarks/source_grad.py, M = 37 at D = 1280, M = 25 at
# D = 1024; RESULTS.md session 11) 3 stages took 0.79x / 0.90x the time of 2;
# 4 stages, 8 warps, 2 warps at 3 stages within 2% of it; 1 token a program
# slower. benchmarks/source_grad.py --tunings and stack_routing.py
# --source_grad_tuning override them.
TUNING: dict = {"elems_per_thread": 24, "warps": 4, "stages": 3}


@triton.jit
def source_grad_kernel(s_ptr, r_ptr, dx_ptr, t_ptr, lse_ptr, xd_ptr, acc_ptr,
                       coef_ptr, ds_init, dlr_init, coefo_init, I, IX, IS, IA,
                       M, N, ds_ptr, dlr_ptr, coefo_ptr,
                       D: tl.constexpr, H: tl.constexpr, C: tl.constexpr,
                       HP: tl.constexpr, CA: tl.constexpr, CB: tl.constexpr,
                       BN: tl.constexpr, STAGES: tl.constexpr,
                       INIT: tl.constexpr, PARTIAL: tl.constexpr):
  """One token tile of the gradient of one source from all its readers.

  ``s_ptr [R_s, N, D]`` (source dtype), the source in row ``IS``; ``r_ptr
  [N]`` fp32, ``t_ptr [R, D]`` fp32, ``lse_ptr``/``xd_ptr [R, N, H]`` fp32,
  rows ``I .. I+M-1`` used; ``dx_ptr [R', N, D]`` the site cotangents, site
  ``I + k`` in row ``IX + k``. INIT: the sums include the share of later
  sites, row ``IA`` of ``acc_ptr [R_a, N, D]`` (source dtype) and of
  ``coef_ptr [R_a, N, H]`` fp32 (:func:`sources_partial`), added after the
  loop; otherwise those are unused. Rows are read in place, so no caller
  slices (copies) a row out of a buffer.
  Outputs
  ``ds_ptr [N, D]`` (source dtype) and
  ``dlr_ptr [M, H, N]`` fp32 (heads major: the query-gain product reads a
  head's tokens contiguously). PARTIAL: the sums are left for earlier sites
  to continue: ``ds_ptr`` gets ``acc`` and ``coefo_ptr [N, H]`` fp32 ``coef``
  (otherwise unused). Parameter order is ``triton_route._launch``'s:
  inputs, an unused init per output (poisoned when testing), runtime scalars
  (not specialised: one compiled kernel serves every source), outputs,
  constexprs.
  """
  tile = tl.program_id(0)
  cola, cmska, colb, cmskb = _cols(H, C, HP, CA, CB)
  base, offa, mska, offb, mskb, hbase, hoff, hmask = _rows(
      tile, N, cola, cmska, colb, cmskb, D, H, HP, BN)
  rows, rmask = _token_ids(tile, N, BN)
  n64 = N + tl.zeros((), tl.int64)          # N may be specialised to 1
  nd = n64 * D
  nh = n64 * H
  xa, xb = _load(s_ptr + IS * nd, base, offa, mska, offb, mskb, CB)
  doff = tl.arange(0, HP).to(tl.int64)[None, :] * n64 + rows[:, None]
  xa = xa.to(tl.float32)
  xb = xb.to(tl.float32)
  r = tl.load(r_ptr + rows, mask=rmask, other=0.0)
  acca, accb = _zeros(BN, HP, CA, CB)
  coef = tl.zeros((BN, HP), tl.float32)
  for k in tl.range(0, M, num_stages=STAGES):
    j = (I + k).to(tl.int64)
    jx = (IX + k).to(tl.int64)
    dxa, dxb = _load(dx_ptr + jx * nd, base, offa, mska, offb, mskb, CB)
    dxa = dxa.to(tl.float32)
    dxb = dxb.to(tl.float32)
    tka, tkb = _load(t_ptr + j * D, 0, cola, cmska, colb, cmskb, CB)
    lse = tl.load(lse_ptr + j * nh + hbase + hoff, mask=hmask, other=0.0)
    xd = tl.load(xd_ptr + j * nh + hbase + hoff, mask=hmask, other=0.0)
    logit = r[:, None] * _hsum(xa * tka[None, :, :], xb * tkb[None, :, :], CB)
    w = tl.exp(logit - lse)
    dl = w * (_hsum(dxa * xa, dxb * xb, CB) - xd)
    dlr = dl * r[:, None]
    acca += w[:, :, None] * dxa + dlr[:, :, None] * tka[None, :, :]
    if CB > 0:
      accb += w[:, :, None] * dxb + dlr[:, :, None] * tkb[None, :, :]
    coef += dl * logit
    tl.store(dlr_ptr + k * nh + doff, dlr, mask=hmask)
  # INIT: the later sites' share joins after the loop, its accumulator last
  # (loaded before the loop it held 155 registers against 127 at D 1280;
  # starting the sums from it took 1.04-1.14x the time, RESULTS session 21).
  if INIT:
    coef += tl.load(coef_ptr + IA * nh + hbase + hoff, mask=hmask, other=0.0)
  if PARTIAL:
    tl.store(coefo_ptr + hbase + hoff, coef, mask=hmask)
    outa = acca
    outb = accb
  else:
    scale = (tl.sum(coef, axis=1) * r * r / D)[:, None, None]
    outa = acca - scale * xa
    outb = accb - scale * xb
  if INIT:
    ia, ib = _load(acc_ptr + IA * nd, base, offa, mska, offb, mskb, CB)
    outa += ia.to(tl.float32)
    outb += ib.to(tl.float32)
  _store(ds_ptr, base, offa, mska, offb, mskb, outa, outb, CB)


def tokens_per_program(d: int, h: int) -> int:
  return _tokens_per_program(tile_width(d, h), TUNING["elems_per_thread"],
                             TUNING["warps"])


def source_grad_local(s, r, dX, t, lse, xd, i: int, h: int,
                      m: int | None = None, init=None,
                      dx_row: int | None = None, partial: bool = False,
                      s_row: int | None = None, init_row: int | None = None):
  """One source's gradient on local (unsharded) arrays.

  ``s [N, D]`` (with ``s_row``: a buffer ``[R_s, N, D]`` holding the source
  in that row), ``r [N]``, ``t [R, D]``, ``lse``/``xd [R, N, H]``; sites
  ``i .. i+m-1`` read the source (``m`` defaults to ``R - i``); ``dX [R', N,
  D]`` holds their cotangents from row ``dx_row`` (default ``i``);
  ``init``: None or ``(acc [N, D], coef [N, H])``, the share of later sites
  (:func:`sources_partial_local`, or this with ``partial``; with
  ``init_row``: buffers ``[R_a, N, D]``, ``[R_a, N, H]`` holding it in that
  row). Buffers are read in place: a row sliced out of one would be a copy.
  Returns ``(ds [N, D], dt [m, D])`` with ``dt`` this source's share of the
  query-gain gradient of those sites; ``partial``: ``(acc [N, D], coef [N,
  H], dt)``, the share of those sites (and ``init``'s) for earlier sites to
  continue.
  """
  S = s[None] if s_row is None else s
  _, n, d = S.shape
  m = t.shape[0] - i if m is None else m
  dx_row = i if dx_row is None else dx_row
  c = d // h
  bn = tokens_per_program(d, h)
  if init is None:
    acc, coef = S, r                      # unused when not INIT
  else:
    acc, coef = init if init_row is not None else (x[None] for x in init)
  ds, dlr, coef_out = tr._launch(
      source_grad_kernel, [S, r.astype(jnp.float32), dX, t, lse, xd, acc,
                           coef], [i, dx_row, s_row or 0, init_row or 0, m, n],
      [jax.ShapeDtypeStruct((n, d), S.dtype),
       jax.ShapeDtypeStruct((m, h, n), jnp.float32),
       jax.ShapeDtypeStruct((n, h) if partial else (1,), jnp.float32)],
      grid=(triton.cdiv(n, bn),), num_warps=TUNING["warps"],
      poison=tr.POISON, dummy=t, **tile_meta(d, h), BN=bn,
      STAGES=TUNING["stages"], INIT=init is not None, PARTIAL=partial)
  if qgrad_supported(c):
    dt = query_gain_grad(dlr, (1, h * n, n), S, s_row or 0, n, m, h)
  else:
    dt = jnp.einsum("mhn,nhc->mhc", dlr, S[s_row or 0].astype(
        jnp.float32).reshape(n, h, c),
                    precision=jax.lax.Precision.HIGHEST).reshape(m, d)
  return (ds, coef_out, dt) if partial else (ds, dt)


# The query-gain gradient's product, ``dt[m, c] = sum_k dlr[k, m, h(c)]
# S[k, c]`` over the K token rows of a buffer the source kernels read (one
# source's N tokens, or a group's G x N), on tensor cores. XLA's product would
# read a row range of a buffer that the backward updates in place only after
# copying it out (XLA fuses a slice into a product's operand only from a
# parameter); this reads the rows in place. Programs: one head of up to 192
# channels (its C channels as the two parts of ``triton_route.head_parts``:
# each ``dlr`` element read once) or a block of a wider head's channels
# (:func:`qgrad_launch`) x a chunk of at least ``chunk_tokens`` tokens (at
# most ``max_chunks`` chunks) x a block of MB (16, 32 or 64) sites, each
# writing its chunk's partial sum; XLA adds the chunks. ``sites16`` /
# ``sites32`` / ``sites64``: ``"WxT"``, W warps and T tokens a step for that
# site block.
# One H100, D 1280, H 8 (benchmarks/source_grad.py --qgrad; RESULTS.md
# session 20): one source x 16 sites, 16 sources x 27 and x 59 sites took
# 0.046, 0.675 and 0.838 ms (72%, 89%, 93% of copy bandwidth; 4 x 64 within 2%
# at 16 sites, 3% / 8% slower at 27 / 59), against 0.073 and 1.606 ms before
# the rows' alignment was known and whole heads were taken (46%, 37%); XLA's
# einsum of standalone arrays (which reads them without a copy) took 1.5-2.2x
# the time of the kernel before that, so the kernel serves those too.
QGRAD_TUNING: dict = {"chunk_tokens": 1024, "max_chunks": 64, "stages": 3,
                      "sites16": "2x32", "sites32": "2x32", "sites64": "4x32"}


@triton.jit
def query_gain_grad_kernel(d_ptr, s_ptr, out_init, K, M, SK, SM, SH, ROW, N,
                           KC, out_ptr, D: tl.constexpr, C: tl.constexpr,
                           PW: tl.constexpr, CA: tl.constexpr,
                           CB: tl.constexpr, MB: tl.constexpr,
                           BK: tl.constexpr, STAGES: tl.constexpr,
                           LOWP: tl.constexpr, UNIT: tl.constexpr,
                           DA: tl.constexpr, EVEN_K: tl.constexpr,
                           WHOLE_M: tl.constexpr):
  """Channels ``[PW p0, PW (p0 + 1))`` of head ``h`` (PW = C: the whole head,
  as parts ``[0, CA)`` and ``[CA, C)`` of CB lanes, masked unless CB = C -
  CA; CB = 0: one part, PW = CA), tokens ``[KC p1, KC (p1 + 1))``, sites
  ``[MB p2, MB (p2 + 1))``::

      out[p1, m, c] = sum_k d[k SK + m SM + h SH] * s[(ROW N + k) D + c]

  ``d_ptr`` fp32, ``s_ptr`` a buffer of rows ``[.., N, D]`` (K token rows
  read from row ``ROW``), ``out_ptr [chunks, M, D]`` fp32 (``out_init``:
  unused, as in ``triton_route._launch``). UNIT 1: tokens are contiguous in
  ``d`` (SK = 1), UNIT 2: sites are (SM = 1); the other two strides are
  given divided by DA (so that the compiler knows the rows' alignment, as it
  knows ``s``'s from D). EVEN_K: K is a multiple of BK (no token mask).
  WHOLE_M: ``d`` is read in whole site blocks (no site mask: rows past M
  exist and reach only output rows that are not stored).
  LOWP (16-bit ``s``): ``d`` as two 16-bit terms (hi + lo, ~16 bits), else
  exact fp32 products.
  """
  col0 = tl.program_id(0).to(tl.int64) * PW
  h = col0 // C
  chunk = tl.program_id(1)
  ms = tl.program_id(2) * MB + tl.arange(0, MB)
  mm = ms < M
  m64 = ms.to(tl.int64)
  ca = col0 + tl.arange(0, CA)
  kb = tl.arange(0, BK)
  sdt = s_ptr.dtype.element_ty
  if UNIT == 1:
    drow = d_ptr + (m64[:, None] * SM + h * SH) * DA
  else:
    drow = d_ptr + m64[:, None] + h * SH * DA
  srow = s_ptr + (ROW + tl.zeros((), tl.int64)) * N * D   # ROW may be 1
  k_lo = chunk * KC
  k_hi = tl.minimum(K, k_lo + KC)
  acca = tl.zeros((MB, CA), tl.float32)
  FULL_B: tl.constexpr = CB == C - CA      # part B's lanes all channels
  if CB > 0:
    cb = col0 + CA + tl.arange(0, CB)
    cbm = cb < col0 + C
    accb = tl.zeros((MB, CB), tl.float32)
  for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
    ks = (k0 + kb).to(tl.int64)
    if EVEN_K:
      km = kb < BK
    else:
      km = ks < k_hi
    if UNIT == 1:
      dk = drow + ks[None, :]
    else:
      dk = drow + ks[None, :] * SK * DA
    if WHOLE_M:
      dmask = km[None, :]
    else:
      dmask = mm[:, None] & km[None, :]
    hi, lo = _split(_load_tile(dk, dmask, WHOLE_M and EVEN_K), sdt, LOWP)
    sk = srow + ks[:, None] * D
    acca += _dot2(hi, lo, _load_tile(sk + ca[None, :], km[:, None], EVEN_K),
                  LOWP)
    if CB > 0:
      sb = _load_tile(sk + cb[None, :], km[:, None] & cbm[None, :],
                      EVEN_K and FULL_B)
      accb += _dot2(hi, lo, sb, LOWP)
  orow = out_ptr + (chunk * M + m64)[:, None] * D
  tl.store(orow + ca[None, :], acca, mask=mm[:, None])
  if CB > 0:
    tl.store(orow + cb[None, :], accb, mask=mm[:, None] & cbm[None, :])


def qgrad_supported(c: int) -> bool:
  """Whether :func:`query_gain_grad` takes heads of ``c`` channels (see
  :func:`qgrad_launch`)."""
  return _whole_heads(c) or c % 16 == 0


def _whole_heads(c: int) -> bool:
  """Whether a program of :func:`query_gain_grad_kernel` takes a whole head
  of ``c`` channels (up to 192, both parts of ``head_parts`` >= 16 lanes)."""
  ca, cb = tr.head_parts(c)
  return c <= 192 and ca >= 16 and (cb == 0 or cb >= 16)


def qgrad_launch(c: int, m: int) -> dict:
  """Constexprs ``PW``, ``CA``, ``CB``, ``MB``, ``BK`` and ``warps`` of
  :func:`query_gain_grad_kernel` for heads of ``c`` channels and ``m``
  sites, under ``QGRAD_TUNING``: a program takes a whole head of up to 192
  channels, as the two parts of ``head_parts`` (each at least ``tl.dot``'s 16
  lanes), else a block of channels, the largest power of two dividing ``c``
  up to 128 (at least 16)."""
  mb = min(64, max(16, 1 << (m - 1).bit_length()))
  key = f"sites{mb}"
  try:
    warps, bk = (int(x) for x in str(QGRAD_TUNING[key]).split("x"))
  except ValueError:
    raise ValueError(f"QGRAD_TUNING[{key!r}] = {QGRAD_TUNING[key]!r}: give "
                     "'WxT', W warps and T tokens a step (e.g. '4x64')"
                     ) from None
  ca, cb = tr.head_parts(c)
  pw = c
  if not _whole_heads(c):
    pw = ca = min(c & -c, 128)
    cb = 0
  return dict(PW=pw, CA=ca, CB=cb, MB=mb, BK=bk, warps=warps)


def query_gain_grad(dlr, strides, S, row: int, k: int, m: int, h: int):
  """``dt [m, D]`` fp32: ``sum_k dlr[k, j, head] S_k`` over the ``k`` token
  rows of ``S [R, N, D]`` from row ``row`` (``row`` x N tokens in), where
  ``dlr``'s element (token k, site j, head) is at ``k SK + j SM + head SH``
  for ``strides = (SK, SM, SH)``, SK or SM one. Reads ``S`` in place; needs
  :func:`qgrad_supported` heads."""
  _, n, d = S.shape
  c = d // h
  if not qgrad_supported(c):
    raise ValueError(f"query_gain_grad: heads of {c} channels are neither "
                     "whole heads of two parts of >= 16 lanes (up to 192) nor"
                     " blocks of 16 or more")
  sk, sm, sh = strides
  if 1 not in (sk, sm):
    raise ValueError(f"query_gain_grad: strides {strides} have neither "
                     "tokens nor sites contiguous")
  unit = 1 if sk == 1 else 2
  rest = (sm, sh) if unit == 1 else (sk, sh)
  da = next(a for a in (4, 2, 1) if all(x % a == 0 for x in rest))
  tu = QGRAD_TUNING
  cfg = qgrad_launch(c, m)
  warps, bk = cfg.pop("warps"), cfg["BK"]
  # Sites contiguous: a site block past M stays within the head's row when
  # the row is padded that far (as sources_kernel pads it).
  whole_m = unit == 2 and triton.cdiv(m, cfg["MB"]) * cfg["MB"] <= sh
  kc = max(int(tu["chunk_tokens"]), triton.cdiv(k, int(tu["max_chunks"])))
  kc = triton.cdiv(kc, bk) * bk
  chunks = triton.cdiv(k, kc)
  (part,) = tr._launch(
      query_gain_grad_kernel, [dlr, S],
      [k, m, sk // da if unit == 2 else 1, sm // da if unit == 1 else 1,
       sh // da, row, n, kc],
      [jax.ShapeDtypeStruct((chunks, m, d), jnp.float32)],
      grid=(d // cfg["PW"], chunks, triton.cdiv(m, cfg["MB"])),
      num_warps=warps, poison=tr.POISON, dummy=dlr, D=d, C=c,
      STAGES=int(tu["stages"]), LOWP=S.dtype != jnp.float32, UNIT=unit,
      DA=da, EVEN_K=k % bk == 0, WHOLE_M=whole_m, **cfg)
  return part.sum(0)


@triton.jit
def _no_write_kernel(x_ptr, out_init, TAG, out_ptr):
  """Writes nothing: its output is a buffer of whatever the memory held."""
  pass


def rows_buffer_local(rows: int, like, dtype, tag: int):
  """``[rows, *like.shape]`` in ``dtype``, contents undefined (NaN when
  testing with ``triton_route.poison_outputs``): a launch that writes
  nothing, so XLA allocates the buffer and fills nothing. ``tag`` (a kernel
  argument, unused) keeps XLA from merging two such launches of one program
  into one buffer, which it would then copy for each writer. The launch's
  one input is an element of ``like``, so it runs after ``like`` is made
  (with no input, XLA's scheduler may hoist it, and the buffer's memory
  with it, to the program's start)."""
  dummy = like.reshape(-1)[:1].astype(dtype)
  (out,) = tr._launch(
      _no_write_kernel, [dummy], [int(tag)],
      [jax.ShapeDtypeStruct((rows, *like.shape), dtype)], grid=(1,),
      num_warps=1, poison=tr.POISON, dummy=dummy)
  return out


def rows_buffer(rows: int, like, tag: int, mesh=None, batch_axes=(),
                dtype=None):
  """A ``[rows, *like.shape]`` buffer in ``dtype`` (default ``like``'s), for
  buffers whose every row is written before it is read, without the
  ``jnp.zeros`` fill (at 1b, 6 GB written a microbatch for nothing):
  :func:`rows_buffer_local`, sharded like ``like``'s leading (token) dim
  over the batch axes of ``mesh``. The buffer is made after ``like`` (its
  launch reads one element of it): pass the first array written into it,
  or XLA may allocate it long before it is used. ``tag``: distinct for every
  buffer of one program."""
  dtype = like.dtype if dtype is None else dtype
  local = lambda like: rows_buffer_local(rows, like, dtype, tag)  # noqa: E731
  if mesh is None or not batch_axes:
    return local(like)
  tok, _, site, _ = _specs(batch_axes, like.ndim - 1)
  return jax.shard_map(local, mesh=mesh, in_specs=(tok,), out_specs=site,
                       check_vma=False)(like)


# A sublayer's input RMSNorm's backward as the stack takes it (``norm`` of
# ``stack.routed_stack``), one launch a site: ``x`` and ``dy`` read once, ``dx``
# written once into its row of a cotangent buffer (aliased: no copy), with the
# routing's ``<dx, x>`` per head and the gain's gradient. XLA takes the same
# in three or four fusions, each reading ``x`` and ``dy`` or ``dx`` again, at
# 27-31% of copy bandwidth alone (one H100, 8 sites a call, D 512-1280:
# RESULTS.md session 31). Persistent: ``programs_per_sm`` programs an SM loop
# over token tiles of ``elems_per_thread`` fp32 elements a thread, each
# keeping its share of the gain's gradient, written once (summed in XLA).
# Compiled for sm_90 (tools/kernel_resources.py): 97-106 registers at D 512
# to 2048 with 8 warps, so 2 programs (16 warps) an SM.
# ``kernel``: whether the Triton path uses it (else autodiff, as the jnp path).
# On one H200 it takes 0.70-0.92x XLA's time for the same norms (D 512-1280)
# and 1.4-2.6% off the training step at 100m, 350m and 1b, full and Block
# (RESULTS.md session 33).
# ``dy_terms``: the most terms of ``dy`` the kernel reads and adds itself
# (1 to ``NORM_DY_TERMS``). A sublayer's input feeds several matrix products
# (attention's Q, K, V; SwiGLU's gate and up), so its cotangent is their
# sum; XLA's baseline fuses that add into its norm backward, but before a
# custom call it is a kernel of its own (read 2-3 arrays, write 1; 7.7 ms of
# a 1b step on an H100, RESULTS.md session 40). With more than 1 the stack
# hands the kernel the terms instead (``stack._cotangent_terms``). 3 against
# 1 in one run (1b full, H100, two 16k microbatches): 602.9 against 605.6 ms
# a step, the same plan (RESULTS.md session 43).
NORM_TUNING: dict = {"elems_per_thread": 16, "warps": 8, "stages": 3,
                     "programs_per_sm": 2, "kernel": True, "dy_terms": 3}
NORM_DY_TERMS = 3          # dy pointers of norm_grad_kernel


@triton.jit
def norm_grad_kernel(x_ptr, dy_ptr, dy1_ptr, dy2_ptr, g_ptr, buf_in,
                     buf_init, xd_init, dg_init, ROW, X_ROW, N, buf_ptr,
                     xd_ptr, dg_ptr, D: tl.constexpr, H: tl.constexpr,
                     C: tl.constexpr, HP: tl.constexpr, CA: tl.constexpr,
                     CB: tl.constexpr, BN: tl.constexpr, EPS: tl.constexpr,
                     STAGES: tl.constexpr, NDY: tl.constexpr):
  """The gradient of ``y = x * rsqrt(mean(x^2) + EPS) * g`` for ``dy``.

  ``x`` is row ``X_ROW`` of ``x_ptr [X, N, D]``; ``dy`` the sum of the NDY
  (1 to 3) arrays ``dy_ptr``, ``dy1_ptr``, ``dy2_ptr [N, D]``, added in fp32
  (the pointers past NDY are placeholders); ``g_ptr [D]`` fp32. Per token,
  with ``r = rsqrt(mean(x^2) + EPS)`` and ``m = sum_c x_c g_c dy_c``::

      dx = r g dy - x r^3 m / D        (rounded to the buffer's dtype)
      xd_h = <dx, x>_h                 dg += dy x r

  ``dx`` goes to row ``ROW`` of ``buf_ptr [R, N, D]`` (aliased to
  ``buf_in``; the other rows are kept), ``xd_ptr [N, H]`` fp32, and program
  ``p``'s sum of ``dy x r`` over its tokens to row ``p`` of ``dg_ptr [P,
  D]`` fp32. Program ``p`` of ``P`` takes token tiles ``p, p + P, ...``."""
  pid = tl.program_id(0)
  progs = tl.num_programs(0)
  cola, cmska, colb, cmskb = _cols(H, C, HP, CA, CB)
  ga, gb = _load(g_ptr, 0, cola, cmska, colb, cmskb, CB)
  n64 = N + tl.zeros((), tl.int64)          # N may be specialised to 1
  dst = buf_ptr + ROW * n64 * D
  src = x_ptr + X_ROW * n64 * D
  dga, dgb = _zeros(BN, HP, CA, CB)      # dy x r, summed over tiles
  for tile in tl.range(pid, tl.cdiv(N, BN), progs, num_stages=STAGES):
    base, offa, mska, offb, mskb, hbase, hoff, hmask = _rows(
        tile, N, cola, cmska, colb, cmskb, D, H, HP, BN)
    xa, xb = _load(src, base, offa, mska, offb, mskb, CB)
    dya, dyb = _load(dy_ptr, base, offa, mska, offb, mskb, CB)
    xa = xa.to(tl.float32)
    xb = xb.to(tl.float32)
    dya = dya.to(tl.float32)
    dyb = dyb.to(tl.float32)
    if NDY > 1:
      da, db = _load(dy1_ptr, base, offa, mska, offb, mskb, CB)
      dya += da.to(tl.float32)
      dyb += db.to(tl.float32)
    if NDY > 2:
      da, db = _load(dy2_ptr, base, offa, mska, offb, mskb, CB)
      dya += da.to(tl.float32)
      dyb += db.to(tl.float32)
    r = tl.rsqrt(tl.sum(_hsum(xa * xa, xb * xb, CB), axis=1) / D + EPS)
    rt = r[:, None, None]
    dga += dya * xa * rt
    if CB > 0:
      dgb += dyb * xb * rt
    gya = dya * ga[None, :, :]
    gyb = dyb * gb[None, :, :]
    c = (r * r * r * tl.sum(_hsum(xa * gya, xb * gyb, CB), axis=1) / D)
    ct = c[:, None, None]
    dxa = (rt * gya - ct * xa).to(buf_ptr.dtype.element_ty).to(tl.float32)
    dxb = (rt * gyb - ct * xb).to(buf_ptr.dtype.element_ty).to(tl.float32)
    _store(dst, base, offa, mska, offb, mskb, dxa, dxb, CB)
    tl.store(xd_ptr + hbase + hoff, _hsum(dxa * xa, dxb * xb, CB),
             mask=hmask)
  out = dg_ptr + pid.to(tl.int64) * D
  tl.store(out + cola, tl.sum(dga, axis=0), mask=cmska)
  if CB > 0:
    tl.store(out + colb, tl.sum(dgb, axis=0), mask=cmskb)


def norm_grad_programs(n: int, d: int, h: int) -> tuple[int, int]:
  """``(BN, P)``: tokens a tile and programs of :func:`norm_grad_kernel`
  for ``n`` tokens at width ``d`` with ``h`` heads."""
  tu = NORM_TUNING
  # At least 2 where the loop is pipelined (stages > 1): with one token a
  # tile Triton 3.6 fails to compile it at D 1280 (RemoveLayoutConversions:
  # "operand #0 does not dominate this use"; tools/kernel_resources.py
  # --kernels norm_grad). Unpipelined, one token a tile compiles.
  bn = max(1 if int(tu["stages"]) == 1 else 2,
           _tokens_per_program(tile_width(d, h), int(tu["elems_per_thread"]),
                               int(tu["warps"])))
  return bn, max(1, min(triton.cdiv(n, bn),
                        tr._num_sms() * int(tu["programs_per_sm"])))


def _dy_terms(dy) -> list:
  """``dy`` (an array, or a sequence of 1 to ``NORM_DY_TERMS`` arrays of one
  shape whose sum is the cotangent) as a list, checked."""
  terms = [dy] if hasattr(dy, "shape") else list(dy)
  if not 1 <= len(terms) <= NORM_DY_TERMS or any(
      t.shape != terms[0].shape for t in terms):
    raise ValueError(
        f"norm_grad: dy must be an array or 1 to {NORM_DY_TERMS} arrays of"
        f" one shape, got {[getattr(t, 'shape', t) for t in terms]}.")
  return terms


def norm_grad_local(x, scale, dy, eps: float, h: int, buf, row: int,
                    x_row: int | None = None):
  """A sublayer input RMSNorm's gradient into a row of a buffer, local arrays.

  ``x``, ``dy [N, D]`` (the norm's input and its output's cotangent, or a
  sequence of 1 to ``NORM_DY_TERMS`` arrays whose sum it is, added in the
  kernel in float32; with ``x_row``, the input is row ``x_row`` of ``x [X,
  N, D]``, read in place), ``scale [D]`` the gain, ``buf [R, N, D]``.
  Returns ``(buf`` with row
  ``row`` = ``dx`` in ``buf``'s dtype (the others kept; updated in place),
  ``<dx, x> [N, H]`` float32 of that rounded ``dx``, ``dscale [D]``
  float32)``: the VJP of ``reference.rms_norm(x, scale, eps)`` and
  ``stack.dot_heads``, up to float32 rounding."""
  terms = _dy_terms(dy)
  n, d = terms[0].shape
  bn, progs = norm_grad_programs(n, d, h)
  dys = terms + terms[:1] * (NORM_DY_TERMS - len(terms))   # placeholders
  buf, xd, dg = tr._launch(
      norm_grad_kernel, [x, *dys, scale.astype(jnp.float32), buf],
      [int(row), 0 if x_row is None else int(x_row), n],
      [jax.ShapeDtypeStruct(buf.shape, buf.dtype),
       jax.ShapeDtypeStruct((n, h), jnp.float32),
       jax.ShapeDtypeStruct((progs, d), jnp.float32)],
      grid=(progs,), num_warps=int(NORM_TUNING["warps"]),
      carry={0: 2 + NORM_DY_TERMS}, poison=tr.POISON, dummy=x,
      **tile_meta(d, h), BN=bn, EPS=float(eps),
      STAGES=int(NORM_TUNING["stages"]), NDY=len(terms))
  return buf, xd, dg.sum(0)


def norm_grad(x, scale, dy, eps: float, h: int, buf, row: int, mesh=None,
              batch_axes=(), x_row: int | None = None):
  """:func:`norm_grad_local` on ``x``, ``dy [tokens..., D]`` (or 1 to
  ``NORM_DY_TERMS`` such arrays whose sum it is) and ``buf [R, tokens...,
  D]`` (with ``x_row``, ``x [X, tokens..., D]`` and its row ``x_row`` the
  input), under ``shard_map`` over the batch axes of ``mesh`` when given
  (``dscale`` psummed). Returns ``(buf, xd [tokens..., H], dscale [D])``."""
  from jax.sharding import PartitionSpec as P
  terms = tuple(_dy_terms(dy))

  def local(x, scale, dys, buf):
    loc = dys[0].shape[:-1]
    flat = lambda a: a.reshape(-1, a.shape[-1])   # noqa: E731
    rows = lambda a: a.reshape(a.shape[0], -1, a.shape[-1])   # noqa: E731
    out, xd, dg = norm_grad_local(
        flat(x) if x_row is None else rows(x), scale,
        [flat(t) for t in dys], eps, h, rows(buf), row, x_row)
    if mesh is not None and batch_axes:
      dg = jax.lax.psum(dg, batch_axes)
    return out.reshape(buf.shape), xd.reshape(*loc, h), dg

  if mesh is None or not batch_axes:
    return local(x, scale, terms, buf)
  tok, _, site, _ = _specs(batch_axes, terms[0].ndim - 1)
  return jax.shard_map(local, mesh=mesh,
                       in_specs=(tok if x_row is None else site, P(),
                                 (tok,) * len(terms), site),
                       out_specs=(site, tok, P()), check_vma=False)(
                           x, scale, terms, buf)


def _specs(batch_axes, lead: int):
  """PartitionSpecs of ``[tokens..., last]``, ``[tokens...]``, ``[R,
  tokens..., last]`` and ``[R, tokens...]`` arrays with ``lead`` token dims,
  the first split over ``batch_axes``."""
  from jax.sharding import PartitionSpec as P
  first = ((batch_axes if len(batch_axes) > 1 else batch_axes[0])
           if batch_axes else None)
  rest = [None] * (lead - 1)
  return (P(first, *rest, None), P(first, *rest), P(None, first, *rest, None),
          P(None, first, *rest))


def source_grad(s, r, dX, t, lse, xd, i: int, h: int, mesh=None,
                batch_axes=(), m: int | None = None, init=None,
                dx_row: int | None = None, partial: bool = False,
                s_row: int | None = None, init_row: int | None = None):
  """:func:`source_grad_local` on ``[tokens, ...]`` arrays (``s``: ``[tokens...,
  D]``, or a buffer ``[R_s, tokens..., D]`` with ``s_row``; ``init``: None or
  ``(acc [tokens..., D], coef [tokens..., H])``, as ``partial`` returns them,
  or buffers of such rows with ``init_row``), under ``shard_map`` over the
  batch axes of ``mesh`` when given (``dt`` psummed)."""
  from jax.sharding import PartitionSpec as P
  lead = s.shape[:-1] if s_row is None else s.shape[1:-1]

  def flat(x, rows):
    return x.reshape(x.shape[0], -1, x.shape[-1]) if rows else x.reshape(
        -1, x.shape[-1])

  def local(s, r, dX, t, lse, xd, *init):
    out = source_grad_local(
        flat(s, s_row is not None), r.reshape(-1), flat(dX, True), t,
        flat(lse, True), flat(xd, True), i, h, m,
        tuple(flat(x, init_row is not None) for x in init) or None, dx_row,
        partial, s_row, init_row)
    dt = out[-1]
    if mesh is not None and batch_axes:
      dt = jax.lax.psum(dt, batch_axes)
    loc = r.shape
    sums = (out[0].reshape(*loc, out[0].shape[-1]),
            *(x.reshape(*loc, h) for x in out[1:-1]))
    return (*sums, dt)

  init = () if init is None else tuple(init)
  if mesh is None:
    return local(s, r, dX, t, lse, xd, *init)
  tok, tok_r, site, _ = _specs(batch_axes, len(lead))
  return jax.shard_map(local, mesh=mesh,
                       in_specs=(tok if s_row is None else site, tok_r, site,
                                 P(), site, site,
                                 *((tok if init_row is None else site)
                                   for _ in init)),
                       out_specs=(tok, *([tok] * partial), P()),
                       check_vma=False)(s, r, dX, t, lse, xd, *init)


# Routing G sites at once over the same sources (the first phase of
# ``routed_stack(..., site_group=G)``) as attention on tensor cores: per token
# and head the G queries ``t_g [C]`` meet the sources as keys and values. On the
# H200 (benchmarks/depth_attention.py, RESULTS.md session 12) 16 sites over 16 /
# 37 sources (D 1280) took 0.37x / 0.26x the time of triton_route's G-site
# launch, with 16 tokens a program, 4 warps, 3 stages. Session 18 (one H100,
# benchmarks/depth_attention.py, 16 sites over 37 sources, D 1280): one
# loop over (token, block) pairs took 0.85x the time of a loop per token
# (each with its own pipelined loop over blocks; since removed) at 4 warps,
# 0.63x at 2 warps and 0.57x at 1 warp (74% of copy bandwidth; 253
# registers, 8 programs an SM). Groups of fewer than ``min_sites`` sites use
# triton_route's G-site launch (the kernel pads G to 16), unless the stack
# saves its source buffer (``stack._forward``). ``split_weights`` (16-bit
# sources): the softmax weights enter the weighted sum as two 16-bit terms
# (~16 bits, one more product a block) instead of one (8 bits for bf16, as
# FlashAttention's). In a bf16 stack of 18 sites (a GPU test) one term took
# the worst gradient's error against the fp32 computation to 2.0x the bf16
# reference's, two terms to 1.41x (fp32 weights: 1.35x); two terms cost 0,
# 1.6% and 2.2% of the kernel's time at 16, 37 and 73 sources (D 1280, one
# H100; RESULTS.md sessions 27-28).
SITES_TUNING: dict = {"tokens_per_program": 16, "warps": 1, "stages": 3,
                      "source_block": 16, "min_sites": 8,
                      "split_weights": True}


@triton.jit
def _load_tile(ptr, mask, FULL: tl.constexpr):
  """``tl.load(ptr)`` where ``mask`` is known to be all true (FULL), else
  masked with zeros."""
  if FULL:
    return tl.load(ptr)
  else:
    return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def _split(t, dt: tl.constexpr, LOWP: tl.constexpr):
  """fp32 ``t`` as two terms ``(hi, lo)`` in ``dt`` (LOWP: ~16 mantissa bits
  together for bf16) or ``(t, t)`` (the second unused)."""
  if LOWP:
    hi = t.to(dt)
    return hi, (t - hi.to(tl.float32)).to(dt)
  else:
    return t, t


@triton.jit
def _dot2(hi, lo, b, LOWP: tl.constexpr):
  """``(hi + lo) @ b``: two low-precision products (LOWP), else one exact
  fp32 product."""
  if LOWP:
    return tl.dot(hi, b) + tl.dot(lo, b)
  else:
    return tl.dot(hi, b, input_precision="ieee")


@triton.jit
def _dot(a, b, LOWP: tl.constexpr):
  """``a @ b``: a product of 16-bit operands (LOWP), else exact fp32."""
  if LOWP:
    return tl.dot(a, b)
  else:
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _flat_step(it, nb, tile, N, BT: tl.constexpr, B: tl.constexpr):
  """Step ``it`` of a flat loop over (token, block of B rows) pairs, ``nb``
  blocks a token, BT tokens from tile ``tile``: ``(first row of the block,
  token, token read)``, the last one int64 and N - 1 for a token past N."""
  i = it // nb
  nn = tile * BT + i
  return (it - i * nb) * B, nn, tl.minimum(nn, N - 1).to(tl.int64)


@triton.jit
def _sites_tiles(xp, sm, ca, cb, cbm, CA: tl.constexpr, CB: tl.constexpr,
                 EVEN_S: tl.constexpr, FULL_B: tl.constexpr):
  """A block's source rows as loaded: ``(xa [SB, CA], xb [SB, CB])`` from the
  row pointers ``xp [SB]`` (the head's first channel), rows where ``sm``
  (zeros elsewhere); CB = 0: ``xb`` is ``xa`` (a placeholder)."""
  xa = _load_tile(xp[:, None] + ca[None, :], sm[:, None], EVEN_S)
  if CB > 0:
    xb = _load_tile(xp[:, None] + CA + cb[None, :], sm[:, None] & cbm[None, :],
                    FULL_B)
  else:
    xb = xa
  return xa, xb


@triton.jit
def _sites_block(xa, xb, rp, sm, cm, ta_hi, ta_lo, tb_hi, tb_lo, m,
                 lsum, acca, accb, CB: tl.constexpr,
                 LOWP: tl.constexpr, EVEN_S: tl.constexpr,
                 CAUSAL: tl.constexpr, SPLIT_P: tl.constexpr):
  """One block of SB sources at one token and head folded into G sites'
  online softmax ``(m, lsum, acca, accb)`` (``m`` -inf: a fresh start);
  SPLIT_P (with LOWP): the weights as two 16-bit terms in the sum.

  ``xa``, ``xb``: the block's rows as :func:`_sites_tiles` loads them; ``rp``
  points at their inverse RMS, ``sm [SB]`` says which sources exist,
  ``cm [G, SB]`` (CAUSAL) which of them each site reads;
  ``t*_hi``/``t*_lo [G, CA|CB]`` the queries (two terms when LOWP). CB = 0:
  ``tb_*``/``accb`` are placeholders, returned as given."""
  if not LOWP:
    xa = xa.to(tl.float32)
  u = _dot2(ta_hi, ta_lo, tl.trans(xa), LOWP)
  if CB > 0:
    if not LOWP:
      xb = xb.to(tl.float32)
    u += _dot2(tb_hi, tb_lo, tl.trans(xb), LOWP)
  logit = u * _load_tile(rp, sm, EVEN_S)[None, :]
  if CAUSAL:
    logit = tl.where(cm & sm[None, :], logit, float("-inf"))
  elif not EVEN_S:
    logit = tl.where(sm[None, :], logit, float("-inf"))
  m_new = tl.maximum(m, tl.max(logit, axis=1))
  alpha = tl.exp(m - m_new)                  # 0 on a fresh start
  p = tl.exp(logit - m_new[:, None])
  lsum = lsum * alpha + tl.sum(p, axis=1)
  acca = acca * alpha[:, None] + _weighted(p, xa, LOWP, SPLIT_P)
  if CB > 0:
    accb = accb * alpha[:, None] + _weighted(p, xb, LOWP, SPLIT_P)
  return m_new, lsum, acca, accb


@triton.jit
def _weighted(p, x, LOWP: tl.constexpr, SPLIT_P: tl.constexpr):
  """``p @ x``, fp32 weights ``p [G, SB]`` on sources ``x [SB, C]``: with
  LOWP in ``x``'s dtype, ``p`` rounded once (as FlashAttention's) or, SPLIT_P,
  as two terms; otherwise exact fp32."""
  if LOWP and SPLIT_P:
    hi, lo = _split(p, x.dtype, LOWP)
    return _dot2(hi, lo, x, LOWP)
  else:
    return _dot(p.to(x.dtype), x, LOWP)


@triton.jit
def _sites_store(out_ptr, lse_ptr, ooff, loff, mask, ca, cb, cbm, m, lsum,
                 acca, accb, dt: tl.constexpr, CA: tl.constexpr,
                 CB: tl.constexpr):
  """G sites' results at one token and head: ``acc / lsum`` at ``ooff [G]``
  (row offsets, the head's first channel) and ``m + log(lsum)`` at ``loff
  [G]``, rows where ``mask``."""
  inv = 1.0 / lsum[:, None]
  tl.store(out_ptr + ooff[:, None] + ca[None, :], (acca * inv).to(dt),
           mask=mask[:, None])
  if CB > 0:
    tl.store(out_ptr + ooff[:, None] + CA + cb[None, :], (accb * inv).to(dt),
             mask=mask[:, None] & cbm[None, :])
  tl.store(lse_ptr + loff, m + tl.log(lsum), mask=mask)


@triton.jit
def sites_kernel(x_ptr, r_ptr, t_ptr, out_init, lse_init, S, GV, N, OUT_ROW,
                 out_ptr, lse_ptr,
                 D: tl.constexpr, H: tl.constexpr, C: tl.constexpr,
                 CA: tl.constexpr, CB: tl.constexpr, G: tl.constexpr,
                 SB: tl.constexpr, BT: tl.constexpr, STAGES: tl.constexpr,
                 LOWP: tl.constexpr, EVEN_S: tl.constexpr,
                 CAUSAL: tl.constexpr, SPLIT_P: tl.constexpr):
  """BT tokens of head ``program_id(1)``: GV sites over the first S sources.

  ``x_ptr [R, N, D]`` (R >= S rows of sources), ``r_ptr [S, N]`` fp32 inverse
  RMS, ``t_ptr [GV, D]`` fp32 queries * gains. Outputs ``out_ptr [GV, N, D]``
  (the sources' dtype) and ``lse_ptr [GV, N, H]`` fp32, site g in row
  ``OUT_ROW + g`` of each (``*_init``: unused, as in
  ``triton_route._launch``)::

      logit[g, s] = r_s <t_g, x_s>_h      lse[g] = logsumexp_s logit[g, s]
      out[g]      = sum_s exp(logit[g, s] - lse[g]) x_s

  CAUSAL: site g reads only the sources ``s <= S - GV + g`` (the last site
  all S: consecutive sites of the full method, each reading one source more).

  Per token, ``[G, C] x [C, SB]`` then ``[G, SB] x [SB, C]`` products (G a
  power of two >= 16 >= GV; rows >= GV are masked) with an online softmax over
  blocks of SB sources. A head's C channels are the two power-of-two parts
  ``[0, CA)`` and ``[CA, C)`` (CB lanes, masked; CB = 0: none) of
  ``triton_route.head_parts``. LOWP (16-bit sources): products in the
  sources' dtype, the queries as two terms (hi + lo), the softmax weights
  rounded once, as FlashAttention's (SPLIT_P: two terms too); otherwise
  exact fp32 products. EVEN_S: S is a multiple of SB (the source loop
  unmasked). One software-pipelined loop over (token, block) pairs, so the
  next token's first blocks load while this token's last ones are summed
  (tokens past N redo token N - 1 unstored).
  """
  tile = tl.program_id(0)
  h = tl.program_id(1)
  dt = x_ptr.dtype.element_ty
  g = tl.arange(0, G)
  gm = g < GV
  ca = tl.arange(0, CA)
  ta_hi, ta_lo = _split(tl.load(t_ptr + g[:, None] * D + h * C + ca[None, :],
                                mask=gm[:, None], other=0.0), dt, LOWP)
  if CB > 0:
    cb = tl.arange(0, CB)
    cbm = cb < C - CA
    tb_hi, tb_lo = _split(
        tl.load(t_ptr + g[:, None] * D + h * C + CA + cb[None, :],
                mask=gm[:, None] & cbm[None, :], other=0.0), dt, LOWP)
  else:                                    # placeholders, never read
    cb = ca
    cbm = ca < CA
    tb_hi = ta_hi
    tb_lo = ta_lo
  sb = tl.arange(0, SB)
  FULL_B: tl.constexpr = EVEN_S and CB == C - CA   # part B's loads unmasked
  n64 = N + tl.zeros((), tl.int64)          # N may be specialised to 1
  nd = n64 * D
  srow = sb.to(tl.int64) * nd               # a block's rows, from its first
  gout = (OUT_ROW + g).to(tl.int64) * nd
  glse = (OUT_ROW + g).to(tl.int64) * n64 * H + h
  # CAUSAL: site g's last source (rows >= GV are masked at the store).
  glast = S - GV + g
  m = tl.full((G,), float("-inf"), tl.float32)
  lsum = tl.zeros((G,), tl.float32)
  acca = tl.zeros((G, CA), tl.float32)
  accb = tl.zeros((G, CB if CB > 0 else CA), tl.float32)
  nb = tl.cdiv(S, SB)
  steps = BT * nb
  xh = x_ptr + srow + h * C     # a block's rows at head h's first channel
  for it in tl.range(0, steps, num_stages=STAGES):
    s0, nn, n = _flat_step(it, nb, tile, N, BT, SB)
    row = n * D + h * C
    sm = s0 + sb < S
    xa, xb = _sites_tiles(xh + s0 * nd + n * D, sm, ca, cb, cbm, CA, CB, EVEN_S,
                          FULL_B)
    m = tl.where(s0 == 0, float("-inf"), m)
    m, lsum, acca, accb = _sites_block(
        xa, xb, r_ptr + (s0 + sb) * n64 + n, sm,
        (s0 + sb)[None, :] <= glast[:, None], ta_hi, ta_lo, tb_hi, tb_lo, m,
        lsum, acca, accb, CB, LOWP, EVEN_S, CAUSAL, SPLIT_P)
    if s0 + SB >= S:
      _sites_store(out_ptr, lse_ptr, gout + row, glse + n * H,
                   tl.where(nn < N, gm, False), ca, cb, cbm, m, lsum, acca,
                   accb, dt, CA, CB)


def sites_supported(d: int, h: int, g: int) -> bool:
  """Whether the tensor-core kernels take ``g`` rows (sites of
  :func:`sites_local`, sources of :func:`sources_partial_local`) at width
  ``d`` with ``h`` heads: both parts of a head's channels must be >= 16 lanes
  (``tl.dot``'s minimum; 160 = 128 + 32 is, 72 = 64 + 8 is not) and ``1 <= g
  <= 64`` (padded to 16 or the next power of two)."""
  ca, cb = head_parts(d // h)
  return d % h == 0 and ca >= 16 and (cb == 0 or cb >= 16) and 1 <= g <= 64


def sites_local(x, r, s: int, t, h: int, causal: bool = False,
                out_row: int | None = None):
  """G sites over the first ``s`` rows of a source buffer, local arrays.

  ``x [R, N, D]`` (rows ``0 .. s-1`` are the sources), ``r [s, N]`` their
  inverse RMS, ``t [G, D]`` the sites' query * gain. Returns ``(out [G, N, D]``
  in ``x``'s dtype, ``lse [G, N, H]`` float32)`` as
  ``stack._sites`` computes them; ``causal``: site g reads only the rows
  ``0 .. s - G + g`` (G consecutive sites of the full method, the last
  reading all ``s``), as ``stack._sites_jnp(causal=True)``.

  ``out_row``: the outputs go into rows ``out_row .. out_row + G - 1`` of
  ``x`` itself (updated in place: the first output is ``x`` with those rows
  written; rows at or past ``s``, e.g. a buffer's rows for sources not yet
  made) and of an ``lse [R, N, H]`` (its other rows unwritten).
  """
  _, n, d = x.shape
  g = t.shape[0]
  sb = int(SITES_TUNING["source_block"])
  if causal and not 1 <= g <= s:
    raise ValueError(f"sites_local: {g} causal sites over {s} rows; the"
                     " first site must read at least one row (G <= s).")
  t = t.astype(jnp.float32)
  rows, carry = g, None
  if out_row is not None:
    if not s <= out_row <= x.shape[0] - g:
      raise ValueError(
          f"sites_local: out_row={out_row} for {g} sites over the first {s}"
          f" of {x.shape[0]} rows; the outputs need rows of their own past"
          f" the sources' (s <= out_row <= R - G).")
    rows, carry = x.shape[0], {0: 0}
  return _group_launch(
      "sites_local", sites_kernel, SITES_TUNING, [x, r.astype(jnp.float32), t],
      [int(s), g, n, int(out_row or 0)],
      [jax.ShapeDtypeStruct((rows, n, d), x.dtype),
       jax.ShapeDtypeStruct((rows, n, h), jnp.float32)],
      x.dtype, n, d, h, g, carry=carry, SB=sb, EVEN_S=s % sb == 0,
      CAUSAL=bool(causal), SPLIT_P=bool(SITES_TUNING["split_weights"]))


def _group_launch(name, kernel, tu, inputs, scalars, out_shapes, dtype, n, d,
                  h, g, carry=None, **meta):
  """Launches a tensor-core kernel of G rows (``g`` used, 1 to 64) over
  tokens x heads with tuning ``tu`` (``tokens_per_program``, ``warps``,
  ``stages``); ``carry`` as in
  ``triton_route._launch``."""
  if not sites_supported(d, h, g):
    raise ValueError(f"{name}: {g} rows at D={d}, H={h} are not supported"
                     " (see sites_supported)")
  bt = int(tu["tokens_per_program"])
  c = d // h
  ca, cb = head_parts(c)
  # the unused init pointers: an input no output aliases (passing an aliased
  # buffer again would make XLA copy it)
  dummy = next(x for i, x in enumerate(inputs)
               if i not in (carry or {}).values())
  return tr._launch(
      kernel, inputs, scalars, out_shapes, grid=(triton.cdiv(n, bt), h),
      num_warps=int(tu["warps"]), carry=carry, poison=tr.POISON,
      dummy=dummy, D=d,
      H=h, C=c, CA=ca, CB=cb, G=max(16, 1 << (g - 1).bit_length()), BT=bt,
      STAGES=int(tu["stages"]), LOWP=dtype != jnp.float32, **meta)


def sites(x, r, s: int, t, h: int, mesh=None, batch_axes=(),
          causal: bool = False, out_row: int | None = None):
  """:func:`sites_local` on ``x [R, tokens..., D]``, ``r [s, tokens...]``,
  under ``shard_map`` over the batch axes of ``mesh`` when given. Returns
  ``(out [G, tokens..., D], lse [G, tokens..., H])``; ``out_row``: ``(x``
  with rows ``out_row ..`` written``, lse [R, tokens..., H])``."""
  from jax.sharding import PartitionSpec as P
  lead = x.shape[1:-1]

  def local(x, r, t):
    loc = x.shape[1:-1]
    out, lse = sites_local(x.reshape(x.shape[0], -1, x.shape[-1]),
                           r.reshape(r.shape[0], -1), s, t, h, causal,
                           out_row)
    return (out.reshape(out.shape[0], *loc, x.shape[-1]),
            lse.reshape(lse.shape[0], *loc, h))

  if mesh is None:
    return local(x, r, t)
  _, _, rows, rows_r = _specs(batch_axes, len(lead))
  return jax.shard_map(local, mesh=mesh,
                       in_specs=(rows, rows_r, P()),
                       out_specs=(rows, rows), check_vma=False)(x, r, t)


# The backward's counterpart (``routed_stack(..., site_group=G)``'s backward):
# the share of the sites above a group of G sources in those sources'
# gradients, per token and head as tensor-core products over blocks of
# ``site_block`` sites. On the H200 (RESULTS.md session 13; 16 sources x 48
# sites, D 1280) 0.279x the time of 16 source_grad launches; these settings
# were the best of five (2 stages, 4 tokens a program, 8 warps, 32 sites a
# block were 1-72% slower). A site count that is a multiple of the block
# compiles without the loop's masks (every group at 1b and 350m). Session 18
# (one H100, benchmarks/source_grad.py --group 16 --m 16, one block a token):
# one loop over (token, block) pairs took 0.74x the time of a loop per token
# (since removed; 2 warps: 0.74x, a loop per token at 2 warps 0.79x).
# ``max_buffers``: how many cotangent buffers one launch reads (1 to
# SOURCES_BUFFERS). With recomputed sources a group's sites above lie in one
# buffer per group, and each launch more reads the group's sources and sums
# again: 3 more launches at 350m, 6 at 1b (~12 and ~32 GB a step by byte
# count). Off (1): on an H100 at 350m with ``recompute_sources='attention'``
# 4 saves 2.3 ms of that setting's 9 ms a step for 0.2 GiB more peak
# (RESULTS.md session 25), and XLA's plan of the 1b step lays out the same
# 66.07 GiB of live temporaries 1.5 GiB worse with it (81.39 against 79.85
# GiB; session 24); ``attention`` is chosen to save memory.
SOURCES_TUNING: dict = {"tokens_per_program": 16, "warps": 4, "stages": 3,
                        "site_block": 16, "max_buffers": 1}
SOURCES_BUFFERS = 4          # cotangent buffers sources_kernel can read (NX)


@triton.jit
def _load2(hi_ptr, lo_ptr, off, mask, LOWP: tl.constexpr, FULL: tl.constexpr):
  """The two terms ``(hi, lo)`` at ``off`` (LOWP), else ``(x, x)``."""
  hi = _load_tile(hi_ptr + off, mask, FULL)
  if LOWP:
    return hi, _load_tile(lo_ptr + off, mask, FULL)
  else:
    return hi, hi


@triton.jit
def _dot_lo(a, b_hi, b_lo, LOWP: tl.constexpr):
  """``a @ (b_hi + b_lo)`` (LOWP: two low-precision products), else the
  exact fp32 ``a @ b_hi``."""
  if LOWP:
    return tl.dot(a, b_hi) + tl.dot(a, b_lo)
  else:
    return tl.dot(a, b_hi, input_precision="ieee")


@triton.jit
def _sources_block(t_ptr, tlo_ptr, dx_ptr, lse_ptr, xd_ptr, dlr_ptr, toff,
                   xoff, loff, doff, km, dmask, sa, sb, rg, ca, cb, cbm, coef,
                   acca, accb, CA: tl.constexpr, CB: tl.constexpr,
                   LOWP: tl.constexpr, EVEN_M: tl.constexpr,
                   FULL_B: tl.constexpr):
  """One block of MB sites at one token and head added to G sources' sums
  ``(coef, acca, accb)``, their ``dlogit * r`` stored at ``doff [G, MB]``
  where ``dmask``.

  ``toff [MB, 1]``, ``xoff [MB, 1]``: the sites' query and cotangent rows
  (the head's first channel), ``loff [MB]`` their statistics, ``km [MB]``
  which sites exist; ``sa``/``sb [G, CA|CB]`` the sources, ``rg [G]`` their
  inverse RMS. CB = 0: ``sb``/``accb`` are placeholders, returned as
  given."""
  ta_hi, ta_lo = _load2(t_ptr, tlo_ptr, toff + ca[None, :], km[:, None], LOWP,
                        EVEN_M)
  dxa = _load_tile(dx_ptr + xoff + ca[None, :], km[:, None], EVEN_M)
  if not LOWP:
    dxa = dxa.to(tl.float32)
  u = _dot_lo(sa, tl.trans(ta_hi), tl.trans(ta_lo), LOWP)   # [G, MB]
  dp = _dot(sa, tl.trans(dxa), LOWP)
  if CB > 0:
    kbm = km[:, None] & cbm[None, :]
    tb_hi, tb_lo = _load2(t_ptr, tlo_ptr, toff + CA + cb[None, :], kbm, LOWP,
                          FULL_B)
    dxb = _load_tile(dx_ptr + xoff + CA + cb[None, :], kbm, FULL_B)
    if not LOWP:
      dxb = dxb.to(tl.float32)
    u += _dot_lo(sb, tl.trans(tb_hi), tl.trans(tb_lo), LOWP)
    dp += _dot(sb, tl.trans(dxb), LOWP)
  lse = _load_tile(lse_ptr + loff, km, EVEN_M)
  xd = _load_tile(xd_ptr + loff, km, EVEN_M)
  logit = rg[:, None] * u
  if EVEN_M:
    w = tl.exp(logit - lse[None, :])
  else:
    w = tl.where(km[None, :], tl.exp(logit - lse[None, :]), 0.0)
  dl = w * (dp - xd[None, :])
  dlr = dl * rg[:, None]
  coef += tl.sum(dl * logit, axis=1)
  tl.store(dlr_ptr + doff, dlr, mask=dmask)
  # ``dlogit r`` enters in 16 bits, so the queries' low term would add
  # precision below its rounding: one product with the high term (LOWP).
  wo = w.to(dxa.dtype)
  do = dlr.to(dxa.dtype)
  acca += _dot(wo, dxa, LOWP) + _dot(do, ta_hi, LOWP)
  if CB > 0:
    accb += _dot(wo, dxb, LOWP) + _dot(do, tb_hi, LOWP)
  return coef, acca, accb


@triton.jit
def _sources_load(s_ptr, r_ptr, soff, roff, gm, ca, cb, cbm,
                  CA: tl.constexpr, CB: tl.constexpr, LOWP: tl.constexpr):
  """G sources at one token and head (``soff [G]`` their rows, the head's
  first channel) as ``(sa, sb, rg)``; CB = 0: ``sb`` is ``sa``."""
  sa = tl.load(s_ptr + soff[:, None] + ca[None, :], mask=gm[:, None],
               other=0.0)
  if not LOWP:
    sa = sa.to(tl.float32)
  sb = sa
  if CB > 0:
    sb = tl.load(s_ptr + soff[:, None] + CA + cb[None, :],
                 mask=gm[:, None] & cbm[None, :], other=0.0)
    if not LOWP:
      sb = sb.to(tl.float32)
  rg = tl.load(r_ptr + roff, mask=gm, other=0.0)
  return sa, sb, rg


@triton.jit
def _sources_store(acc_ptr, coef_ptr, aoff, coff, mask, ca, cb, cbm, coef,
                   acca, accb, dt: tl.constexpr, CA: tl.constexpr,
                   CB: tl.constexpr, INIT: tl.constexpr):
  """G sources' sums at one token and head to ``aoff [G]`` (rows, the head's
  first channel) and ``coef`` to ``coff [G]``, rows where ``mask``; INIT:
  added to what is there."""
  if INIT:
    acca += tl.load(acc_ptr + aoff[:, None] + ca[None, :], mask=mask[:, None],
                    other=0.0).to(tl.float32)
    if CB > 0:
      accb += tl.load(acc_ptr + aoff[:, None] + CA + cb[None, :],
                      mask=mask[:, None] & cbm[None, :],
                      other=0.0).to(tl.float32)
    coef += tl.load(coef_ptr + coff, mask=mask, other=0.0)
  tl.store(acc_ptr + aoff[:, None] + ca[None, :], acca.to(dt),
           mask=mask[:, None])
  if CB > 0:
    tl.store(acc_ptr + aoff[:, None] + CA + cb[None, :], accb.to(dt),
             mask=mask[:, None] & cbm[None, :])
  tl.store(coef_ptr + coff, coef, mask=mask)


@triton.jit
def sources_kernel(s_ptr, r_ptr, dx_ptr, dx1_ptr, dx2_ptr, dx3_ptr, t_ptr,
                   tlo_ptr, lse_ptr, xd_ptr, acc_in, coef_in, acc_init,
                   coef_init, dlr_init, I0, GV, J0, JX, JX1, JX2, JX3, K1, K2,
                   K3, M, MP, N, acc_ptr, coef_ptr, dlr_ptr,
                   D: tl.constexpr, H: tl.constexpr, C: tl.constexpr,
                   CA: tl.constexpr, CB: tl.constexpr, G: tl.constexpr,
                   MB: tl.constexpr, BT: tl.constexpr, STAGES: tl.constexpr,
                   LOWP: tl.constexpr, EVEN_M: tl.constexpr,
                   INIT: tl.constexpr, NX: tl.constexpr):
  """BT tokens of head ``program_id(1)``: the share of the sites ``J0 ..
  J0+M-1`` in the gradients of the GV sources in rows ``I0 .. I0+GV-1``.

  ``s_ptr [R, N, D]`` (a source buffer), ``r_ptr [GV, N]`` fp32 the sources'
  inverse RMS; whole-stack ``t_ptr [R', D]`` the sites' query * gain (LOWP:
  its high part in the sources' dtype, ``tlo_ptr`` the rest; else fp32,
  ``tlo_ptr`` unused), ``lse_ptr``/``xd_ptr [R', N, H]`` fp32; the site
  cotangents in NX (1 to 4) buffers ``[R'', N, D]``, ``dx_ptr``,
  ``dx1_ptr``, ...: site ``J0 + k`` for ``Kp <= k < K(p+1)`` in buffer p,
  row ``JXp + k - Kp`` (``K0 = 0``, ``JX0 = JX``; each ``Kp`` a multiple of
  MB; the pointers and scalars of buffers past NX are placeholders).
  Outputs ``acc_ptr [GV, N, D]`` (sources' dtype), ``coef_ptr [GV, N, H]``
  fp32 and ``dlr_ptr [GV, N, H, MP]`` fp32 (``dlogit * r`` of every pair,
  for the query-gain gradient, sites padded with zeros to MP, M rounded up to
  a multiple of MB by the caller; ``*_init``: unused, as in
  ``triton_route._launch``). INIT: ``acc_ptr``/``coef_ptr`` hold the share of
  other sites on entry (the caller aliases them to ``acc_in``/``coef_in``),
  which the sums continue; otherwise ``acc_in``/``coef_in`` are unused::

      logit[g, k] = r_g <s_g, t_k>_h        w = exp(logit - lse_k)
      dlogit      = w (<dx_k, s_g>_h - xd_k)
      acc[g]      = sum_k w dx_k + dlogit r_g t_k    coef[g] = sum_k dlogit logit

  As :func:`sites_kernel`: per token, ``[G, C] x [C, MB]`` then ``[G, MB] x
  [MB, C]`` products (G >= 16 >= GV rows, masked), C as two parts; LOWP:
  16-bit products, the queries as two terms (split by the caller) in the
  logits, ``w`` and ``dlogit r`` rounded once (so ``dlogit r t`` takes the
  queries' high term only); otherwise exact fp32. One pipelined loop over
  (token, block) pairs, the sources loaded again at every block (tokens past
  N redo token N - 1 unstored).
  """
  tile = tl.program_id(0)
  h = tl.program_id(1)
  dt = s_ptr.dtype.element_ty
  g = tl.arange(0, G)
  gm = g < GV
  ca = tl.arange(0, CA)
  if CB > 0:
    cb = tl.arange(0, CB)
    cbm = cb < C - CA
  else:                                    # placeholders, never read
    cb = ca
    cbm = ca < CA
  kb = tl.arange(0, MB)
  FULL_B: tl.constexpr = EVEN_M and CB == C - CA   # part B's loads unmasked
  n64 = N + tl.zeros((), tl.int64)          # N may be specialised to 1
  nd = n64 * D
  nh = n64 * H
  jb = (J0 + kb).to(tl.int64)               # the first block's sites
  toff0 = jb[:, None] * D + h * C
  xoff0 = (JX + kb).to(tl.int64)[:, None] * nd + h * C   # ... cotangent rows
  loff0 = jb * nh + h
  g64 = g.to(tl.int64)
  srow = (I0 + g).to(tl.int64) * nd + h * C
  grow = g64 * nd + h * C
  doff0 = g64[:, None] * nh * MP + kb[None, :]  # + the token's (n H + h) MP
  coef = tl.zeros((G,), tl.float32)
  acca = tl.zeros((G, CA), tl.float32)
  accb = tl.zeros((G, CB if CB > 0 else CA), tl.float32)
  nb = tl.cdiv(M, MB)
  for it in tl.range(0, BT * nb, num_stages=STAGES):
    k0, nn, n = _flat_step(it, nb, tile, N, BT, MB)
    sa, sb, rg = _sources_load(s_ptr, r_ptr, srow + n * D, g64 * n64 + n,
                               gm, ca, cb, cbm, CA, CB, LOWP)
    fresh = k0 == 0
    coef = tl.where(fresh, 0.0, coef)
    acca = tl.where(fresh, 0.0, acca)
    accb = tl.where(fresh, 0.0, accb)
    ok = tl.where(nn < N, gm, False)      # rows of a token that exists
    dxp, xoff = dx_ptr, xoff0 + n * D + k0 * nd   # the block's cotangents
    if NX > 1:                  # in buffer p: rows moved by JXp - Kp - JX
      shift = tl.zeros((), tl.int64)
      if k0 >= K1:
        dxp, shift = dx1_ptr, (JX1 - K1 - JX).to(tl.int64)
      if NX > 2:
        if k0 >= K2:
          dxp, shift = dx2_ptr, (JX2 - K2 - JX).to(tl.int64)
      if NX > 3:
        if k0 >= K3:
          dxp, shift = dx3_ptr, (JX3 - K3 - JX).to(tl.int64)
      xoff += shift * nd
    coef, acca, accb = _sources_block(
        t_ptr, tlo_ptr, dxp, lse_ptr, xd_ptr,
        dlr_ptr + (n * H + h) * MP, toff0 + k0 * D, xoff,
        loff0 + n * H + k0 * nh, doff0 + k0,
        k0 + kb < M, ok[:, None] & (kb < MB)[None, :], sa, sb, rg, ca,
        cb, cbm, coef, acca, accb, CA, CB, LOWP, EVEN_M, FULL_B)
    if k0 + MB >= M:
      _sources_store(acc_ptr, coef_ptr, grow + n * D,
                     (g64 * n64 + n) * H + h, ok, ca, cb, cbm, coef, acca,
                     accb, dt, CA, CB, INIT)


def sources_dlr_sites(m: int) -> int:
  """Sites of :func:`sources_kernel`'s ``dlr`` for ``m`` sites: ``m`` rounded
  up to whole site blocks (``SOURCES_TUNING["site_block"]``), the rest
  zeros."""
  mb = int(SOURCES_TUNING["site_block"])
  return triton.cdiv(m, mb) * mb


def cotangent_pieces(dX, m: int, dx_row: int):
  """``dX`` as ``sources_partial_local`` takes it: an array holding ``m``
  sites from row ``dx_row``, or a sequence of pieces ``(buffer, first row,
  sites)``. Returns the pieces, checked: at most ``SOURCES_BUFFERS``,
  together ``m`` sites, each after the first starting at a multiple of
  ``SOURCES_TUNING["site_block"]`` sites."""
  if not isinstance(dX, (list, tuple)):
    return [(dX, int(dx_row), int(m))]
  pieces = [(b, int(row), int(k)) for b, row, k in dX]
  counts = [k for _, _, k in pieces]
  mb = int(SOURCES_TUNING["site_block"])
  if not 1 <= len(pieces) <= SOURCES_BUFFERS or sum(counts) != m or any(
      k % mb for k in itertools.accumulate(counts[:-1])):
    raise ValueError(
        f"sources_partial_local: pieces of {counts} sites for {m} sites; at"
        f" most {SOURCES_BUFFERS}, each after the first starting at a"
        f" multiple of {mb} sites")
  return pieces


def mergeable_pieces(sites):
  """``sites`` (site counts of consecutive cotangent buffers) cut into runs
  that one :func:`sources_kernel` launch reads: at most ``max_buffers``
  (``SOURCES_TUNING``, up to ``SOURCES_BUFFERS``) buffers a launch,
  each after a run's first starting at a multiple of the site block (a block
  of sites lies in one buffer). Returns the runs' lengths in pieces."""
  mb, runs, k = int(SOURCES_TUNING["site_block"]), [], 0
  limit = min(max(1, int(SOURCES_TUNING["max_buffers"])), SOURCES_BUFFERS)
  for count in sites:
    if runs and runs[-1] < limit and k % mb == 0:
      runs[-1] += 1
    else:
      runs.append(1)
      k = 0
    k += count
  return runs


def sources_partial_local(S, i0: int, gv: int, r, dX, t, lse, xd, j: int,
                          m: int, h: int, init=None, dx_row: int | None = None,
                          into=None):
  """The share of the sites ``j .. j+m-1`` in the gradients of the sources
  in rows ``i0 .. i0+gv-1`` of a buffer, local arrays.

  ``S [R, N, D]``, ``r [gv, N]``; ``t``, ``lse``, ``xd`` as in
  :func:`source_grad_local`. ``dX``: the sites' cotangents, ``[R'', N, D]``
  holding them from row ``dx_row`` (default ``j``), or pieces ``(buffer
  [R'', N, D], first row, sites)`` holding them in turn (see
  :func:`cotangent_pieces`). ``init``: None, or ``(acc, coef)`` as returned
  here for other sites, which this continues (updated in place). ``into``
  (``init`` None): None, or a buffer ``[R' >= gv, N, D]`` whose rows ``0 ..
  gv-1`` receive ``acc``, the others kept (updated in place). Returns
  ``(acc [gv, N, D]`` (``[R', N, D]``: the buffer, with ``into`` or such an
  ``init``) in ``S``'s dtype, ``coef [gv, N, H]``, ``dt [m, D]`` float32)
  as ``stack.sources_partial`` computes them.
  """
  _, n, d = S.shape
  mb = int(SOURCES_TUNING["site_block"])
  mp = sources_dlr_sites(m)
  pieces = cotangent_pieces(dX, m, j if dx_row is None else dx_row)
  bufs = [b for b, _, _ in pieces]
  rows = [row for _, row, _ in pieces]
  starts = list(itertools.accumulate([k for _, _, k in pieces[:-1]],
                                     initial=0))
  pad = SOURCES_BUFFERS - len(pieces)  # placeholders: the first buffer
  bufs, rows, starts = (bufs + bufs[:1] * pad, rows + [0] * pad,
                        starts[1:] + [0] * pad)
  t = t.astype(jnp.float32)
  if S.dtype != jnp.float32:          # the queries as two terms, split once
    t, t_lo = t.astype(S.dtype), (t - t.astype(S.dtype)).astype(S.dtype)
  else:
    t_lo = t
  if init is not None and into is not None:
    raise ValueError("sources_partial_local: init and into are exclusive")
  acc_in, coef_in = (S, r) if init is None else init   # unused when not INIT
  carry = {0: 10, 1: 11} if init is not None else None
  if into is not None:            # rows written, not added to: INIT off
    acc_in, carry = into, {0: 10}
  acc, coef, dlr = _group_launch(
      "sources_partial_local", sources_kernel, SOURCES_TUNING,
      [S, r.astype(jnp.float32), *bufs, t, t_lo, lse, xd, acc_in, coef_in],
      [int(i0), gv, int(j), *rows, *starts, int(m), mp, n],
      [jax.ShapeDtypeStruct(acc_in.shape if carry else (gv, n, d), S.dtype),
       jax.ShapeDtypeStruct((gv, n, h), jnp.float32),
       jax.ShapeDtypeStruct((gv, n, h, mp), jnp.float32)],
      S.dtype, n, d, h, gv, carry=carry,
      MB=mb, EVEN_M=m % mb == 0, INIT=init is not None, NX=len(pieces))
  c = d // h
  if qgrad_supported(c):                  # the buffer's rows read in place
    dt = query_gain_grad(dlr, (h * mp, 1, mp), S, i0, gv * n, m, h)
  else:
    dt = jnp.einsum("gnhm,gnhc->mhc", dlr[..., :m], S[i0:i0 + gv].astype(
        jnp.float32).reshape(gv, n, h, c),
                    precision=jax.lax.Precision.HIGHEST).reshape(m, d)
  return acc, coef, dt


def sources_partial(S, i0: int, gv: int, r, dX, t, lse, xd, j: int, m: int,
                    h: int, mesh=None, batch_axes=(), init=None,
                    dx_row: int | None = None, into=None):
  """:func:`sources_partial_local` on ``S [R, tokens..., D]``, ``r [gv,
  tokens...]`` and ``[R', tokens..., *]`` buffers (``dX`` one, or pieces as
  there; ``init``: None or ``(acc [gv or R'', tokens..., D], coef [gv,
  tokens..., H])``; ``into``: None or ``[R'', tokens..., D]``), under
  ``shard_map`` over the batch axes of ``mesh`` when given (``dt`` psummed).
  Returns ``(acc [gv or R'', tokens..., D], coef [gv, tokens..., H], dt [m,
  D])``."""
  from jax.sharding import PartitionSpec as P
  lead = S.shape[1:-1]
  pieces = cotangent_pieces(dX, m, j if dx_row is None else dx_row)
  bufs = tuple(b for b, _, _ in pieces)
  extra = (into,) if into is not None else (
      () if init is None else tuple(init))

  def local(S, r, t, lse, xd, *arrays):
    loc = S.shape[1:-1]
    flat = lambda x: x.reshape(x.shape[0], -1, x.shape[-1])  # noqa: E731
    arrays = [flat(x) for x in arrays]
    bufs, extra = arrays[:len(pieces)], arrays[len(pieces):]
    acc, coef, dt = sources_partial_local(
        flat(S), i0, gv, r.reshape(gv, -1),
        [(b, row, k) for b, (_, row, k) in zip(bufs, pieces)], t, flat(lse),
        flat(xd), j, m, h, None if into is not None else (extra or None),
        None, extra[0] if into is not None else None)
    if mesh is not None and batch_axes:
      dt = jax.lax.psum(dt, batch_axes)
    return (acc.reshape(acc.shape[0], *loc, S.shape[-1]),
            coef.reshape(gv, *loc, h), dt)

  if mesh is None:
    return local(S, r, t, lse, xd, *bufs, *extra)
  _, _, rows, rows_r = _specs(batch_axes, len(lead))
  return jax.shard_map(local, mesh=mesh,
                       in_specs=(rows, rows_r, P(), rows, rows,
                                 *(rows for _ in bufs + extra)),
                       out_specs=(rows, rows, P()), check_vma=False)(
                           S, r, t, lse, xd, *bufs, *extra)
