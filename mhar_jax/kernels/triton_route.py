"""Triton kernels for multi-head depth routing (GPU only).

Computes exactly :func:`mhar_jax.kernels.reference.route` (forward and the
hand-written backward ``reference._route_bwd``) with Triton kernels called
through ``jax_triton.triton_call``. This module imports ``jax_triton`` at the
top; :mod:`mhar_jax.kernels` imports it lazily, only on a CUDA backend.

Notation: S sources ``s_i`` of N tokens (all leading dims flattened) by D
channels, H heads of ``C = D/H`` contiguous channels, ``t = query * norm_scale``
(float32, ``[D]``, viewed as ``[H, C]``)::

    r_i[n]      = rsqrt(mean_c s_i[n, c]^2 + eps)
    u_i[n, h]   = sum_{c in h} s_i[n, c] t[c]
    logit_i     = r_i * u_i                                        [N, H]
    lse[n, h]   = logsumexp_i logit_i[n, h]
    w_i         = exp(logit_i - lse)
    out[n, c]   = sum_i w_i[n, head(c)] s_i[n, c]

Design
------
*No stacking.* The sources stay separate arrays (a model passes a growing
Python list). A Triton kernel has a fixed number of pointer arguments, so every
kernel here takes ``MAX_SOURCES_PER_LAUNCH`` source pointers and a constexpr
``NSRC`` (how many are live in this launch; the code for the others is pruned
at compile time, and their slots get a dummy pointer). Sources are processed in
chunks of at most ``CHUNK`` per launch.

*Tiles.* A program owns ``BN`` whole tokens and views each row in two parts
so that a head's channels lie along the last axis and per-head sums are
reductions over it: part a, channels ``[0, CA)`` of every head as ``[HP, CA]``,
and part b, channels ``[CA, C)`` as ``[HP, CB]`` (``HP`` = next power of two of
H, ``CA`` = largest power of two <= C, ``CB`` = next power of two of
``C - CA``, 0 when C is a power of two; :func:`head_parts`). At C = 160 that
is 128 + 32 lanes, no padding, where one ``[HP, pow2(C)]`` view would pad 160
to 256 (37.5% idle lanes, measured to cost about a third of the bandwidth).
Masked lanes never touch memory; padding costs threads and registers.

*Prefetch.* Each source step ends in cross-warp reductions (the sum of
squares spans all heads), which the compiler does not move loads across, so
the unrolled code explicitly issues the load of source ``k + PF`` before
reducing source ``k`` (``PF`` constexpr, 1..4): PF + 1 tiles in flight per
program instead of one.

*Forward* (``_fwd_kernel``): one pass over the sources per token tile with an
online softmax per head: ``r``, ``u``, the logit, a running max ``m``, running
sum ``l`` and an fp32 accumulator ``acc``. With more than ``CHUNK`` sources,
``(m, l, acc)`` are carried between the launches in fp32 buffers (aliased in
place); the last launch writes ``out = acc / l`` in the sources' dtype and
``lse = m + log l`` (``[N, H]`` fp32). The residuals besides the inputs are
``lse`` and (``TUNING["bwd_given_r"]``) each source's ``r`` ``[N]`` fp32, which
the forward writes so the backward kernels need no cross-warp sum of squares;
the backward recomputes ``u`` and the weights from the sources it has to read
anyway. The same kernel routes G sites over the same sources
in one launch (one query per site; the G programs of a token tile are
adjacent in the grid, so they read its sources at about the same time and
mostly from L2), and can start from a routed result ``(out, lse)`` over
earlier sources instead of from nothing (the state ``m = lse, l = 1,
acc = out``): together the two-phase routing of
``stack.routed_stack(..., site_group=G)`` (DESIGN.md §3).

*Backward.* With ``g = d out`` (viewed ``[N, H, C]``), ``dw_i = <g, s_i>`` per
head and ``c = sum_i w_i dw_i`` ([N, H])::

    dlogit_i = w_i (dw_i - c);  du_i = dlogit_i r_i;  dr_i = sum_h dlogit_i u_i
    ds_i     = w_i g + du_i t - (dr_i r_i^3 / D) s_i
    dt       = sum_{n, i} du_i[n, h] s_i[n, c]
    dquery   = dt * norm_scale;   dscale = dt * query

``c`` needs every source's ``dw`` before any ``ds_i`` can be written, so the
exact backward makes two passes: ``_cpass_kernel`` (reads g and every source,
writes ``c``; carried across chunks) and ``_bwd_kernel`` (reads g and every
source, writes every ``ds_i`` and per-program partial sums of ``dt``, which are
added in jnp: deterministic). ``exact_bwd=False`` instead takes
``c = <g, out>`` from the saved output (``sum_i w_i <g, s_i> = <g, out>``):
one pass fewer (4S instead of 6S bytes per element in bf16), exact in float32
inputs but with bf16 rounding of ``out`` in ``c`` for bf16 sources (measured
~4e-3 relative error in dquery, against ~1e-6 for the exact path).

*Sharding.* ``triton_call`` has no partitioning rule, so under a mesh with
more than one device the calls run inside ``jax.shard_map``: tokens (the first
leading dim) split over the batch axes (those the flax logical-axis rules map
``activation_batch`` to, else the mesh axis ``data``; under an Explicit mesh,
the axes that shard the first dim of the first source), D replicated. The
weight gradient ``dt`` is psummed over the batch axes. A D sharded over a
``model`` axis is gathered by ``shard_map``'s in_specs (correct, not
bandwidth-optimal; the kernel-level alternative, a psum of the sum of squares
between a logit pass and a mix pass, is not implemented). Mesh axes that do not
shard the batch compute redundantly. A first dim that does not divide by the
batch axes' size is processed replicated.

Bytes moved per element of one source (b = bytes of the dtype, K = CHUNK,
L = ceil(S/K) launches): forward ``S b + b + 8 (L - 1)``; exact backward
``2 S b`` (two reads) ``+ S b`` (writes) ``+ 2 b`` (g read twice). Measured on
an H200 (bf16, H=8, N=32k, S=37), as a share of copy bandwidth on those bytes:
forward 78% and fwd+bwd 71% at D=1024; 68% and 62% at D=1280
(benchmarks/RESULTS.md, session 9). The forward given each source's inverse
RMS (as ``stack.routed_stack`` calls it) runs at ~90% at D=1280 (session 11).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
import jax_triton as jt
from jax.interpreters import mlir
import triton
import triton.language as tl

from mhar_jax.kernels import ptx_cache, reference

MAX_SOURCES_PER_LAUNCH = 16
# Sources per launch (<= MAX_SOURCES_PER_LAUNCH). Larger means fewer fp32
# carries of the forward accumulator (8 bytes per element per extra launch) but
# longer kernels to compile.
CHUNK = 16

# Tuning knobs: tokens per program are chosen so that each thread holds about
# `*_elems_per_thread` fp32 elements of one [BN, HP, CA + CB] tile.
# `*_prefetch` (1..4): source tiles loaded ahead of the one being reduced.
# `fwd_given_r`: the forward kernel reads each source's inverse RMS when the
# caller passes it (routed_stack does: it computes them anyway) instead of
# summing squares across warps for every source; off, given ones are ignored.
# Compiled for sm_90 by Triton 3.6: 103 -> 72 registers and 68 -> 20 barriers
# at D = 1280, 128 -> 70 and 49 -> 1 at D = 1024 (tools/kernel_resources.py;
# RESULTS.md session 10; timed in session 11: 0.74-0.76x the forward's time).
# `bwd_given_r`: route()'s forward writes each source's inverse RMS (4 bytes a
# token a source, saved for the backward) so the c-pass and backward kernels
# read them instead of summing squares across warps again; off, they do.
# Costs 4 bytes a token for every (site, source) pair of residual memory.
# On the H200 (RESULTS.md session 12) True took 0.874x the fwd+bwd time of
# False at 8 sources, 1.022x at 37 (the backward kernel given r holds 138
# registers against 128 at D = 1280); giving r to the c-pass only was no
# better (session 13) and was removed.
# Defaults: best of the sweep on an H200 (benchmarks/ROUTING_NOTES.md; the
# forward re-checked at D = 1280, benchmarks/RESULTS.md session 9).
# `ffi_launch`: every kernel of this package is launched through jaxlib's
# typed-FFI Triton call (`triton_kernel_call_ffi`, see `_ffi_lowering`),
# which XLA may capture into its command buffers (CUDA graphs) together with
# the fusions around it; jax-triton 0.3.1 emits the legacy
# `triton_kernel_call`, which XLA runs outside them, so each launch also ends
# a command buffer and starts another (read at trace time). Off: on the GPU
# it puts every call in a command buffer (100m: 299 -> 15 host launches a
# step) but the 1b step is no faster (RESULTS.md session 22).
TUNING: dict = {
    "fwd_elems_per_thread": 16, "fwd_warps": 4, "fwd_prefetch": 4,
    "cpass_elems_per_thread": 16, "cpass_warps": 4, "cpass_prefetch": 4,
    "bwd_elems_per_thread": 16, "bwd_warps": 4, "bwd_programs_per_sm": 8,
    "bwd_prefetch": 2,
    "fwd_given_r": True,
    "bwd_given_r": True,
    "ffi_launch": False,
}
# Pin the forward / c-pass accumulators in place (see `_pin`). Off under
# Triton's interpreter, which cannot run inline asm.
PIN_ACCUMULATORS = os.environ.get("TRITON_INTERPRET", "0") not in ("1",
                                                                 "true")

# Debug: fill every output buffer with NaN before the kernel writes it (the
# buffer is passed in and aliased to the output), so an element a kernel fails
# to write shows up. Read at trace time; tests set it through `poison_outputs`.
POISON = bool(int(os.environ.get("MHAR_TRITON_POISON", "0")))


# -----------------------------------------------------------------------------
# Triton kernels
# -----------------------------------------------------------------------------


@triton.jit
def _cols(H: tl.constexpr, C: tl.constexpr, HP: tl.constexpr,
          CA: tl.constexpr, CB: tl.constexpr):
  """Column offsets and masks of a row's two parts.

  Part a is channels ``[0, CA)`` of every head as an ``[HP, CA]`` view
  (offsets ``h*C + c``), part b channels ``[CA, C)`` as ``[HP, CB]``
  (``h*C + CA + c``, masked at ``C - CA``). ``CB = 0`` (C a power of two): no
  part b; its outputs alias part a's and every consumer ignores them.
  """
  h = tl.arange(0, HP)
  ca = tl.arange(0, CA)
  cola = h[:, None] * C + ca[None, :]
  cmska = (h[:, None] < H) & (ca[None, :] < CA)
  if CB > 0:
    cb = tl.arange(0, CB)
    colb = h[:, None] * C + CA + cb[None, :]
    cmskb = (h[:, None] < H) & (cb[None, :] < C - CA)
  else:
    colb = cola
    cmskb = cmska
  return cola, cmska, colb, cmskb


@triton.jit
def _token_ids(tile, N, BN: tl.constexpr):
  """Token indices ``[BN]`` of token tile ``tile`` and which are ``< N``."""
  ids = tile * BN + tl.arange(0, BN)
  return ids, ids < N


@triton.jit
def _rows(tile, N, cola, cmska, colb, cmskb, D: tl.constexpr,
          H: tl.constexpr, HP: tl.constexpr, BN: tl.constexpr):
  """Token tile ``tile``: int64 element offsets of its first row in a
  ``[N, D]`` and an ``[N, H]`` array; int32 offsets inside the tile of part a
  (``[BN, HP, CA]``), part b (``[BN, HP, CB]``) and of ``[BN, HP]``; masks."""
  row0 = tile * BN
  rows = tl.arange(0, BN)
  _, nmask = _token_ids(tile, N, BN)
  base = row0.to(tl.int64) * D
  hbase = row0.to(tl.int64) * H
  roff = rows[:, None, None] * D
  offa = roff + cola[None, :, :]
  mska = nmask[:, None, None] & cmska[None, :, :]
  offb = roff + colb[None, :, :]
  mskb = nmask[:, None, None] & cmskb[None, :, :]
  h = tl.arange(0, HP)
  hoff = rows[:, None] * H + h[None, :]
  hmask = nmask[:, None] & (h[None, :] < H)
  return base, offa, mska, offb, mskb, hbase, hoff, hmask


@triton.jit
def _load(src, base, offa, mska, offb, mskb, CB: tl.constexpr):
  """Both parts of a tile in ``src``'s dtype (issued early)."""
  xa = tl.load(src + base + offa, mask=mska, other=0.0)
  if CB > 0:
    xb = tl.load(src + base + offb, mask=mskb, other=0.0)
  else:
    xb = xa
  return xa, xb


@triton.jit
def _store(dst, base, offa, mska, offb, mskb, va, vb, CB: tl.constexpr):
  """Writes both parts of a tile, cast to ``dst``'s dtype."""
  tl.store(dst + base + offa, va.to(dst.dtype.element_ty), mask=mska)
  if CB > 0:
    tl.store(dst + base + offb, vb.to(dst.dtype.element_ty), mask=mskb)


@triton.jit
def _zeros(BN: tl.constexpr, HP: tl.constexpr, CA: tl.constexpr,
           CB: tl.constexpr):
  """A zero fp32 tile, both parts."""
  za = tl.zeros((BN, HP, CA), tl.float32)
  if CB > 0:
    zb = tl.zeros((BN, HP, CB), tl.float32)
  else:
    zb = za
  return za, zb


@triton.jit
def _hsum(pa, pb, CB: tl.constexpr):
  """Per-head sum over a head's channels of a two-part tile: ``[BN, HP]``."""
  s = tl.sum(pa, axis=2)
  if CB > 0:
    s += tl.sum(pb, axis=2)
  return s


@triton.jit
def _logits(xa, xb, ta, tb, D: tl.constexpr, EPS: tl.constexpr,
            CB: tl.constexpr):
  """From a loaded tile: ``(xa, xb fp32, r [BN], u [BN, HP], logit [BN, HP])``."""
  xa = xa.to(tl.float32)
  xb = xb.to(tl.float32)
  ss = tl.sum(_hsum(xa * xa, xb * xb, CB), axis=1)
  r = tl.rsqrt(ss / D + EPS)
  u = _hsum(xa * ta[None, :, :], xb * tb[None, :, :], CB)
  return xa, xb, r, u, r[:, None] * u


@triton.jit
def _logits_r(xa, xb, r, ta, tb, D: tl.constexpr, EPS: tl.constexpr,
              CB: tl.constexpr, HAS_R: tl.constexpr):
  """:func:`_logits` with the inverse RMS ``r`` ``[BN]`` given (HAS_R: no
  cross-warp sum of squares) or, else, computed from the tile."""
  if HAS_R:
    xa = xa.to(tl.float32)
    xb = xb.to(tl.float32)
    u = _hsum(xa * ta[None, :, :], xb * tb[None, :, :], CB)
    return xa, xb, r, u, r[:, None] * u
  else:
    return _logits(xa, xb, ta, tb, D, EPS, CB)


@triton.jit
def _pin(x, PIN: tl.constexpr):
  """Identity the compiler does not move (a non-pure inline-asm ``mov``).

  Without it LLVM sinks each step's exps and accumulation past the later
  steps' barriers, so every source tile stays live in registers (measured
  with ptxas: forward with 16 sources 250 -> 168 registers, c-pass 173 ->
  80-128). ``PIN=False`` (Triton's interpreter has no inline asm) is the
  plain identity.
  """
  if PIN:
    x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x],
                                  dtype=tl.float32, is_pure=False, pack=1)
  return x


@triton.jit
def _load_r(r_ptr, rrow, rmask, HAS_R: tl.constexpr):
  """A source's inverse RMS ``[BN]`` fp32 when given (else a dummy)."""
  if HAS_R:
    r = tl.load(r_ptr + rrow, mask=rmask, other=1.0)
  else:
    r = rrow
  return r


@triton.jit
def _store_r(r_out, k: tl.constexpr, N, rrow, rmask, r,
             WRITE_R: tl.constexpr):
  """With WRITE_R, row ``k`` of ``r_out`` ``[NSRC, N]`` = a source's inverse
  RMS ``r`` ``[BN]``."""
  if WRITE_R:
    tl.store(r_out + k * N + rrow, r, mask=rmask)


@triton.jit
def _fwd_step(xa, xb, r, ta, tb, m, l, acca, accb, D: tl.constexpr,
              EPS: tl.constexpr, PIN: tl.constexpr, CB: tl.constexpr,
              HAS_R: tl.constexpr):
  """One source of the online softmax: updates ``(m, l, acca, accb)`` and
  returns them with the source's inverse RMS (``r`` ``[BN]`` itself with
  HAS_R, else computed from the tile)."""
  xa, xb, r, _, logit = _logits_r(xa, xb, r, ta, tb, D, EPS, CB, HAS_R)
  m_new = tl.maximum(m, logit)
  alpha = tl.exp(m - m_new)
  p = tl.exp(logit - m_new)
  l = l * alpha + p
  acca = _pin(acca * alpha[:, :, None] + p[:, :, None] * xa, PIN)
  if CB > 0:
    accb = _pin(accb * alpha[:, :, None] + p[:, :, None] * xb, PIN)
  return m_new, l, acca, accb, r


@triton.jit
def _fwd_kernel(
    # <gen:FWD_SRC_PARAMS>
    s0, s1, s2, s3, s4, s5, s6, s7,
    s8, s9, s10, s11, s12, s13, s14, s15,
    r0, r1, r2, r3, r4, r5, r6, r7,
    r8, r9, r10, r11, r12, r13, r14, r15,
    # </gen:FWD_SRC_PARAMS>
    t_ptr, m_in, l_in, acc_in,
    i_out, i_lse, i_m, i_l, i_acc, i_r,
    N, I0,
    out_ptr, lse_ptr, m_out, l_out, acc_out, r_out,
    NSRC: tl.constexpr, INIT: tl.constexpr, LAST: tl.constexpr,
    HAS_R: tl.constexpr, WRITE_R: tl.constexpr, G: tl.constexpr,
    PF: tl.constexpr,
    PIN: tl.constexpr,
    D: tl.constexpr, H: tl.constexpr, C: tl.constexpr, HP: tl.constexpr,
    CA: tl.constexpr, CB: tl.constexpr, BN: tl.constexpr,
    EPS: tl.constexpr):
  """Forward over NSRC sources for BN tokens of G sites (grid: G * cdiv(N, BN),
  the G sites of a token tile adjacent, so they read its sources together).

  Inputs: ``s*`` ``[N, D]`` (sources' dtype); with HAS_R ``r*`` ``[N]`` fp32,
  their inverse RMS (else unused and computed in the kernel); ``t_ptr``
  ``[G, D]`` fp32 (each site's query * gain); the starting state of each
  site, by INIT: 0, none
  (``m_in``, ``l_in``, ``acc_in`` unused); 1, carried ``m_in``/``l_in``
  ``[G, N, H]`` and ``acc_in`` ``[G, N, D]`` fp32; 2, a routed result over
  earlier sources, ``m_in`` = its log-sum-exp ``[R, N, H]`` and ``acc_in`` =
  its output ``[R, N, D]`` (any dtype), site ``g`` starting from row
  ``I0 + g`` (the state ``m = lse, l = 1, acc = out``). ``i_*`` are unused
  (poison buffers aliased to the outputs).
  Outputs: LAST: ``out_ptr`` ``[G, N, D]`` = acc / l in the sources' dtype
  and ``lse_ptr`` ``[G, N, H]`` = m + log l; else ``m_out``, ``l_out``,
  ``acc_out``; WRITE_R (G = 1): ``r_out`` ``[NSRC, N]`` fp32, each source's
  inverse RMS (for the backward). Outputs a variant does not write are
  1-element dummies.
  """
  pid = tl.program_id(0)
  site = pid % G
  cola, cmska, colb, cmskb = _cols(H, C, HP, CA, CB)
  base, offa, mska, offb, mskb, hbase, hoff, hmask = _rows(
      pid // G, N, cola, cmska, colb, cmskb, D, H, HP, BN)
  rrow, rmask = _token_ids(pid // G, N, BN)
  gd = site.to(tl.int64) * N * D        # site offset in [G, N, D] arrays
  gh = site.to(tl.int64) * N * H        # and in [G, N, H] arrays
  if INIT == 2:
    id_ = (site + I0).to(tl.int64) * N * D
    ih = (site + I0).to(tl.int64) * N * H
  else:
    id_ = gd
    ih = gh
  ta, tb = _load(t_ptr + site * D, 0, cola, cmska, colb, cmskb, CB)
  if INIT == 0:
    m = tl.full((BN, HP), float("-inf"), tl.float32)
    l = tl.zeros((BN, HP), tl.float32)
    acca, accb = _zeros(BN, HP, CA, CB)
  else:
    m = tl.load(m_in + ih + hbase + hoff, mask=hmask, other=0.0)
    if INIT == 1:
      l = tl.load(l_in + gh + hbase + hoff, mask=hmask, other=1.0)
    else:
      l = tl.full((BN, HP), 1.0, tl.float32)
    acca, accb = _load(acc_in + id_, base, offa, mska, offb, mskb, CB)
    acca = acca.to(tl.float32)
    accb = accb.to(tl.float32)
  # <gen:FWD_STEPS>
  if PF > 0:
    if NSRC > 0:
      x0a, x0b = _load(s0, base, offa, mska, offb, mskb, CB)
      r0v = _load_r(r0, rrow, rmask, HAS_R)
  if PF > 1:
    if NSRC > 1:
      x1a, x1b = _load(s1, base, offa, mska, offb, mskb, CB)
      r1v = _load_r(r1, rrow, rmask, HAS_R)
  if PF > 2:
    if NSRC > 2:
      x2a, x2b = _load(s2, base, offa, mska, offb, mskb, CB)
      r2v = _load_r(r2, rrow, rmask, HAS_R)
  if PF > 3:
    if NSRC > 3:
      x3a, x3b = _load(s3, base, offa, mska, offb, mskb, CB)
      r3v = _load_r(r3, rrow, rmask, HAS_R)
  if NSRC > 0:
    if PF == 1:
      if NSRC > 1:
        x1a, x1b = _load(s1, base, offa, mska, offb, mskb, CB)
        r1v = _load_r(r1, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 2:
        x2a, x2b = _load(s2, base, offa, mska, offb, mskb, CB)
        r2v = _load_r(r2, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 3:
        x3a, x3b = _load(s3, base, offa, mska, offb, mskb, CB)
        r3v = _load_r(r3, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 4:
        x4a, x4b = _load(s4, base, offa, mska, offb, mskb, CB)
        r4v = _load_r(r4, rrow, rmask, HAS_R)
    m, l, acca, accb, r0w = _fwd_step(
        x0a, x0b, r0v, ta, tb, m, l, acca, accb, D, EPS, PIN, CB,
        HAS_R)
    _store_r(r_out, 0, N, rrow, rmask, r0w, WRITE_R)
  if NSRC > 1:
    if PF == 1:
      if NSRC > 2:
        x2a, x2b = _load(s2, base, offa, mska, offb, mskb, CB)
        r2v = _load_r(r2, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 3:
        x3a, x3b = _load(s3, base, offa, mska, offb, mskb, CB)
        r3v = _load_r(r3, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 4:
        x4a, x4b = _load(s4, base, offa, mska, offb, mskb, CB)
        r4v = _load_r(r4, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 5:
        x5a, x5b = _load(s5, base, offa, mska, offb, mskb, CB)
        r5v = _load_r(r5, rrow, rmask, HAS_R)
    m, l, acca, accb, r1w = _fwd_step(
        x1a, x1b, r1v, ta, tb, m, l, acca, accb, D, EPS, PIN, CB,
        HAS_R)
    _store_r(r_out, 1, N, rrow, rmask, r1w, WRITE_R)
  if NSRC > 2:
    if PF == 1:
      if NSRC > 3:
        x3a, x3b = _load(s3, base, offa, mska, offb, mskb, CB)
        r3v = _load_r(r3, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 4:
        x4a, x4b = _load(s4, base, offa, mska, offb, mskb, CB)
        r4v = _load_r(r4, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 5:
        x5a, x5b = _load(s5, base, offa, mska, offb, mskb, CB)
        r5v = _load_r(r5, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 6:
        x6a, x6b = _load(s6, base, offa, mska, offb, mskb, CB)
        r6v = _load_r(r6, rrow, rmask, HAS_R)
    m, l, acca, accb, r2w = _fwd_step(
        x2a, x2b, r2v, ta, tb, m, l, acca, accb, D, EPS, PIN, CB,
        HAS_R)
    _store_r(r_out, 2, N, rrow, rmask, r2w, WRITE_R)
  if NSRC > 3:
    if PF == 1:
      if NSRC > 4:
        x4a, x4b = _load(s4, base, offa, mska, offb, mskb, CB)
        r4v = _load_r(r4, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 5:
        x5a, x5b = _load(s5, base, offa, mska, offb, mskb, CB)
        r5v = _load_r(r5, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 6:
        x6a, x6b = _load(s6, base, offa, mska, offb, mskb, CB)
        r6v = _load_r(r6, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 7:
        x7a, x7b = _load(s7, base, offa, mska, offb, mskb, CB)
        r7v = _load_r(r7, rrow, rmask, HAS_R)
    m, l, acca, accb, r3w = _fwd_step(
        x3a, x3b, r3v, ta, tb, m, l, acca, accb, D, EPS, PIN, CB,
        HAS_R)
    _store_r(r_out, 3, N, rrow, rmask, r3w, WRITE_R)
  if NSRC > 4:
    if PF == 1:
      if NSRC > 5:
        x5a, x5b = _load(s5, base, offa, mska, offb, mskb, CB)
        r5v = _load_r(r5, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 6:
        x6a, x6b = _load(s6, base, offa, mska, offb, mskb, CB)
        r6v = _load_r(r6, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 7:
        x7a, x7b = _load(s7, base, offa, mska, offb, mskb, CB)
        r7v = _load_r(r7, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 8:
        x8a, x8b = _load(s8, base, offa, mska, offb, mskb, CB)
        r8v = _load_r(r8, rrow, rmask, HAS_R)
    m, l, acca, accb, r4w = _fwd_step(
        x4a, x4b, r4v, ta, tb, m, l, acca, accb, D, EPS, PIN, CB,
        HAS_R)
    _store_r(r_out, 4, N, rrow, rmask, r4w, WRITE_R)
  if NSRC > 5:
    if PF == 1:
      if NSRC > 6:
        x6a, x6b = _load(s6, base, offa, mska, offb, mskb, CB)
        r6v = _load_r(r6, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 7:
        x7a, x7b = _load(s7, base, offa, mska, offb, mskb, CB)
        r7v = _load_r(r7, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 8:
        x8a, x8b = _load(s8, base, offa, mska, offb, mskb, CB)
        r8v = _load_r(r8, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 9:
        x9a, x9b = _load(s9, base, offa, mska, offb, mskb, CB)
        r9v = _load_r(r9, rrow, rmask, HAS_R)
    m, l, acca, accb, r5w = _fwd_step(
        x5a, x5b, r5v, ta, tb, m, l, acca, accb, D, EPS, PIN, CB,
        HAS_R)
    _store_r(r_out, 5, N, rrow, rmask, r5w, WRITE_R)
  if NSRC > 6:
    if PF == 1:
      if NSRC > 7:
        x7a, x7b = _load(s7, base, offa, mska, offb, mskb, CB)
        r7v = _load_r(r7, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 8:
        x8a, x8b = _load(s8, base, offa, mska, offb, mskb, CB)
        r8v = _load_r(r8, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 9:
        x9a, x9b = _load(s9, base, offa, mska, offb, mskb, CB)
        r9v = _load_r(r9, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 10:
        x10a, x10b = _load(s10, base, offa, mska, offb, mskb, CB)
        r10v = _load_r(r10, rrow, rmask, HAS_R)
    m, l, acca, accb, r6w = _fwd_step(
        x6a, x6b, r6v, ta, tb, m, l, acca, accb, D, EPS, PIN, CB,
        HAS_R)
    _store_r(r_out, 6, N, rrow, rmask, r6w, WRITE_R)
  if NSRC > 7:
    if PF == 1:
      if NSRC > 8:
        x8a, x8b = _load(s8, base, offa, mska, offb, mskb, CB)
        r8v = _load_r(r8, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 9:
        x9a, x9b = _load(s9, base, offa, mska, offb, mskb, CB)
        r9v = _load_r(r9, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 10:
        x10a, x10b = _load(s10, base, offa, mska, offb, mskb, CB)
        r10v = _load_r(r10, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 11:
        x11a, x11b = _load(s11, base, offa, mska, offb, mskb, CB)
        r11v = _load_r(r11, rrow, rmask, HAS_R)
    m, l, acca, accb, r7w = _fwd_step(
        x7a, x7b, r7v, ta, tb, m, l, acca, accb, D, EPS, PIN, CB,
        HAS_R)
    _store_r(r_out, 7, N, rrow, rmask, r7w, WRITE_R)
  if NSRC > 8:
    if PF == 1:
      if NSRC > 9:
        x9a, x9b = _load(s9, base, offa, mska, offb, mskb, CB)
        r9v = _load_r(r9, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 10:
        x10a, x10b = _load(s10, base, offa, mska, offb, mskb, CB)
        r10v = _load_r(r10, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 11:
        x11a, x11b = _load(s11, base, offa, mska, offb, mskb, CB)
        r11v = _load_r(r11, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 12:
        x12a, x12b = _load(s12, base, offa, mska, offb, mskb, CB)
        r12v = _load_r(r12, rrow, rmask, HAS_R)
    m, l, acca, accb, r8w = _fwd_step(
        x8a, x8b, r8v, ta, tb, m, l, acca, accb, D, EPS, PIN, CB,
        HAS_R)
    _store_r(r_out, 8, N, rrow, rmask, r8w, WRITE_R)
  if NSRC > 9:
    if PF == 1:
      if NSRC > 10:
        x10a, x10b = _load(s10, base, offa, mska, offb, mskb, CB)
        r10v = _load_r(r10, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 11:
        x11a, x11b = _load(s11, base, offa, mska, offb, mskb, CB)
        r11v = _load_r(r11, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 12:
        x12a, x12b = _load(s12, base, offa, mska, offb, mskb, CB)
        r12v = _load_r(r12, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 13:
        x13a, x13b = _load(s13, base, offa, mska, offb, mskb, CB)
        r13v = _load_r(r13, rrow, rmask, HAS_R)
    m, l, acca, accb, r9w = _fwd_step(
        x9a, x9b, r9v, ta, tb, m, l, acca, accb, D, EPS, PIN, CB,
        HAS_R)
    _store_r(r_out, 9, N, rrow, rmask, r9w, WRITE_R)
  if NSRC > 10:
    if PF == 1:
      if NSRC > 11:
        x11a, x11b = _load(s11, base, offa, mska, offb, mskb, CB)
        r11v = _load_r(r11, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 12:
        x12a, x12b = _load(s12, base, offa, mska, offb, mskb, CB)
        r12v = _load_r(r12, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 13:
        x13a, x13b = _load(s13, base, offa, mska, offb, mskb, CB)
        r13v = _load_r(r13, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 14:
        x14a, x14b = _load(s14, base, offa, mska, offb, mskb, CB)
        r14v = _load_r(r14, rrow, rmask, HAS_R)
    m, l, acca, accb, r10w = _fwd_step(
        x10a, x10b, r10v, ta, tb, m, l, acca, accb, D, EPS, PIN, CB,
        HAS_R)
    _store_r(r_out, 10, N, rrow, rmask, r10w, WRITE_R)
  if NSRC > 11:
    if PF == 1:
      if NSRC > 12:
        x12a, x12b = _load(s12, base, offa, mska, offb, mskb, CB)
        r12v = _load_r(r12, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 13:
        x13a, x13b = _load(s13, base, offa, mska, offb, mskb, CB)
        r13v = _load_r(r13, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 14:
        x14a, x14b = _load(s14, base, offa, mska, offb, mskb, CB)
        r14v = _load_r(r14, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 15:
        x15a, x15b = _load(s15, base, offa, mska, offb, mskb, CB)
        r15v = _load_r(r15, rrow, rmask, HAS_R)
    m, l, acca, accb, r11w = _fwd_step(
        x11a, x11b, r11v, ta, tb, m, l, acca, accb, D, EPS, PIN, CB,
        HAS_R)
    _store_r(r_out, 11, N, rrow, rmask, r11w, WRITE_R)
  if NSRC > 12:
    if PF == 1:
      if NSRC > 13:
        x13a, x13b = _load(s13, base, offa, mska, offb, mskb, CB)
        r13v = _load_r(r13, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 14:
        x14a, x14b = _load(s14, base, offa, mska, offb, mskb, CB)
        r14v = _load_r(r14, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 15:
        x15a, x15b = _load(s15, base, offa, mska, offb, mskb, CB)
        r15v = _load_r(r15, rrow, rmask, HAS_R)
    m, l, acca, accb, r12w = _fwd_step(
        x12a, x12b, r12v, ta, tb, m, l, acca, accb, D, EPS, PIN, CB,
        HAS_R)
    _store_r(r_out, 12, N, rrow, rmask, r12w, WRITE_R)
  if NSRC > 13:
    if PF == 1:
      if NSRC > 14:
        x14a, x14b = _load(s14, base, offa, mska, offb, mskb, CB)
        r14v = _load_r(r14, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 15:
        x15a, x15b = _load(s15, base, offa, mska, offb, mskb, CB)
        r15v = _load_r(r15, rrow, rmask, HAS_R)
    m, l, acca, accb, r13w = _fwd_step(
        x13a, x13b, r13v, ta, tb, m, l, acca, accb, D, EPS, PIN, CB,
        HAS_R)
    _store_r(r_out, 13, N, rrow, rmask, r13w, WRITE_R)
  if NSRC > 14:
    if PF == 1:
      if NSRC > 15:
        x15a, x15b = _load(s15, base, offa, mska, offb, mskb, CB)
        r15v = _load_r(r15, rrow, rmask, HAS_R)
    m, l, acca, accb, r14w = _fwd_step(
        x14a, x14b, r14v, ta, tb, m, l, acca, accb, D, EPS, PIN, CB,
        HAS_R)
    _store_r(r_out, 14, N, rrow, rmask, r14w, WRITE_R)
  if NSRC > 15:
    m, l, acca, accb, r15w = _fwd_step(
        x15a, x15b, r15v, ta, tb, m, l, acca, accb, D, EPS, PIN, CB,
        HAS_R)
    _store_r(r_out, 15, N, rrow, rmask, r15w, WRITE_R)
  # </gen:FWD_STEPS>
  if LAST:
    inv = 1.0 / l[:, :, None]
    _store(out_ptr + gd, base, offa, mska, offb, mskb, acca * inv, accb * inv,
           CB)
    tl.store(lse_ptr + gh + hbase + hoff, m + tl.log(l), mask=hmask)
  else:
    tl.store(m_out + gh + hbase + hoff, m, mask=hmask)
    tl.store(l_out + gh + hbase + hoff, l, mask=hmask)
    _store(acc_out + gd, base, offa, mska, offb, mskb, acca, accb, CB)


@triton.jit
def _cpass_step(xa, xb, r, ta, tb, ga, gb, lse, c, D: tl.constexpr,
                EPS: tl.constexpr, PIN: tl.constexpr, CB: tl.constexpr,
                HAS_R: tl.constexpr):
  """``c += w_i * <g, s_i>`` per head (``r``: see :func:`_logits_r`)."""
  xa, xb, r, u, logit = _logits_r(xa, xb, r, ta, tb, D, EPS, CB, HAS_R)
  w = tl.exp(logit - lse)
  return _pin(c + w * _hsum(ga * xa, gb * xb, CB), PIN)


@triton.jit
def _cpass_kernel(
    # <gen:CPASS_SRC_PARAMS>
    s0, s1, s2, s3, s4, s5, s6, s7,
    s8, s9, s10, s11, s12, s13, s14, s15,
    r0, r1, r2, r3, r4, r5, r6, r7,
    r8, r9, r10, r11, r12, r13, r14, r15,
    # </gen:CPASS_SRC_PARAMS>
    g_ptr, t_ptr, lse_ptr, c_in,
    i_c,
    N,
    c_out,
    NSRC: tl.constexpr, FIRST: tl.constexpr, PF: tl.constexpr,
    PIN: tl.constexpr, HAS_R: tl.constexpr,
    D: tl.constexpr, H: tl.constexpr, C: tl.constexpr, HP: tl.constexpr,
    CA: tl.constexpr, CB: tl.constexpr, BN: tl.constexpr,
    EPS: tl.constexpr):
  """Backward pass 1 (grid: cdiv(N, BN)): ``c = sum_i w_i <g, s_i>_h``.

  Inputs: ``s*`` ``[N, D]``; with HAS_R ``r*`` ``[N]`` fp32, their inverse
  RMS (else unused and computed here); ``g_ptr`` ``[N, D]`` (d out),
  ``t_ptr`` ``[D]``, ``lse_ptr`` ``[N, H]``, and unless FIRST ``c_in``
  ``[N, H]`` (the sum over earlier chunks). Output ``c_out`` ``[N, H]`` fp32.
  """
  pid = tl.program_id(0)
  cola, cmska, colb, cmskb = _cols(H, C, HP, CA, CB)
  base, offa, mska, offb, mskb, hbase, hoff, hmask = _rows(
      pid, N, cola, cmska, colb, cmskb, D, H, HP, BN)
  rrow, rmask = _token_ids(pid, N, BN)
  ta, tb = _load(t_ptr, 0, cola, cmska, colb, cmskb, CB)
  ga, gb = _load(g_ptr, base, offa, mska, offb, mskb, CB)
  ga = ga.to(tl.float32)
  gb = gb.to(tl.float32)
  lse = tl.load(lse_ptr + hbase + hoff, mask=hmask, other=0.0)
  if FIRST:
    c = tl.zeros((BN, HP), tl.float32)
  else:
    c = tl.load(c_in + hbase + hoff, mask=hmask, other=0.0)
  # <gen:CPASS_STEPS>
  if PF > 0:
    if NSRC > 0:
      x0a, x0b = _load(s0, base, offa, mska, offb, mskb, CB)
      r0v = _load_r(r0, rrow, rmask, HAS_R)
  if PF > 1:
    if NSRC > 1:
      x1a, x1b = _load(s1, base, offa, mska, offb, mskb, CB)
      r1v = _load_r(r1, rrow, rmask, HAS_R)
  if PF > 2:
    if NSRC > 2:
      x2a, x2b = _load(s2, base, offa, mska, offb, mskb, CB)
      r2v = _load_r(r2, rrow, rmask, HAS_R)
  if PF > 3:
    if NSRC > 3:
      x3a, x3b = _load(s3, base, offa, mska, offb, mskb, CB)
      r3v = _load_r(r3, rrow, rmask, HAS_R)
  if NSRC > 0:
    if PF == 1:
      if NSRC > 1:
        x1a, x1b = _load(s1, base, offa, mska, offb, mskb, CB)
        r1v = _load_r(r1, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 2:
        x2a, x2b = _load(s2, base, offa, mska, offb, mskb, CB)
        r2v = _load_r(r2, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 3:
        x3a, x3b = _load(s3, base, offa, mska, offb, mskb, CB)
        r3v = _load_r(r3, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 4:
        x4a, x4b = _load(s4, base, offa, mska, offb, mskb, CB)
        r4v = _load_r(r4, rrow, rmask, HAS_R)
    c = _cpass_step(x0a, x0b, r0v, ta, tb, ga, gb, lse, c, D,
                    EPS, PIN, CB, HAS_R)
  if NSRC > 1:
    if PF == 1:
      if NSRC > 2:
        x2a, x2b = _load(s2, base, offa, mska, offb, mskb, CB)
        r2v = _load_r(r2, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 3:
        x3a, x3b = _load(s3, base, offa, mska, offb, mskb, CB)
        r3v = _load_r(r3, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 4:
        x4a, x4b = _load(s4, base, offa, mska, offb, mskb, CB)
        r4v = _load_r(r4, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 5:
        x5a, x5b = _load(s5, base, offa, mska, offb, mskb, CB)
        r5v = _load_r(r5, rrow, rmask, HAS_R)
    c = _cpass_step(x1a, x1b, r1v, ta, tb, ga, gb, lse, c, D,
                    EPS, PIN, CB, HAS_R)
  if NSRC > 2:
    if PF == 1:
      if NSRC > 3:
        x3a, x3b = _load(s3, base, offa, mska, offb, mskb, CB)
        r3v = _load_r(r3, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 4:
        x4a, x4b = _load(s4, base, offa, mska, offb, mskb, CB)
        r4v = _load_r(r4, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 5:
        x5a, x5b = _load(s5, base, offa, mska, offb, mskb, CB)
        r5v = _load_r(r5, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 6:
        x6a, x6b = _load(s6, base, offa, mska, offb, mskb, CB)
        r6v = _load_r(r6, rrow, rmask, HAS_R)
    c = _cpass_step(x2a, x2b, r2v, ta, tb, ga, gb, lse, c, D,
                    EPS, PIN, CB, HAS_R)
  if NSRC > 3:
    if PF == 1:
      if NSRC > 4:
        x4a, x4b = _load(s4, base, offa, mska, offb, mskb, CB)
        r4v = _load_r(r4, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 5:
        x5a, x5b = _load(s5, base, offa, mska, offb, mskb, CB)
        r5v = _load_r(r5, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 6:
        x6a, x6b = _load(s6, base, offa, mska, offb, mskb, CB)
        r6v = _load_r(r6, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 7:
        x7a, x7b = _load(s7, base, offa, mska, offb, mskb, CB)
        r7v = _load_r(r7, rrow, rmask, HAS_R)
    c = _cpass_step(x3a, x3b, r3v, ta, tb, ga, gb, lse, c, D,
                    EPS, PIN, CB, HAS_R)
  if NSRC > 4:
    if PF == 1:
      if NSRC > 5:
        x5a, x5b = _load(s5, base, offa, mska, offb, mskb, CB)
        r5v = _load_r(r5, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 6:
        x6a, x6b = _load(s6, base, offa, mska, offb, mskb, CB)
        r6v = _load_r(r6, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 7:
        x7a, x7b = _load(s7, base, offa, mska, offb, mskb, CB)
        r7v = _load_r(r7, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 8:
        x8a, x8b = _load(s8, base, offa, mska, offb, mskb, CB)
        r8v = _load_r(r8, rrow, rmask, HAS_R)
    c = _cpass_step(x4a, x4b, r4v, ta, tb, ga, gb, lse, c, D,
                    EPS, PIN, CB, HAS_R)
  if NSRC > 5:
    if PF == 1:
      if NSRC > 6:
        x6a, x6b = _load(s6, base, offa, mska, offb, mskb, CB)
        r6v = _load_r(r6, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 7:
        x7a, x7b = _load(s7, base, offa, mska, offb, mskb, CB)
        r7v = _load_r(r7, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 8:
        x8a, x8b = _load(s8, base, offa, mska, offb, mskb, CB)
        r8v = _load_r(r8, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 9:
        x9a, x9b = _load(s9, base, offa, mska, offb, mskb, CB)
        r9v = _load_r(r9, rrow, rmask, HAS_R)
    c = _cpass_step(x5a, x5b, r5v, ta, tb, ga, gb, lse, c, D,
                    EPS, PIN, CB, HAS_R)
  if NSRC > 6:
    if PF == 1:
      if NSRC > 7:
        x7a, x7b = _load(s7, base, offa, mska, offb, mskb, CB)
        r7v = _load_r(r7, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 8:
        x8a, x8b = _load(s8, base, offa, mska, offb, mskb, CB)
        r8v = _load_r(r8, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 9:
        x9a, x9b = _load(s9, base, offa, mska, offb, mskb, CB)
        r9v = _load_r(r9, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 10:
        x10a, x10b = _load(s10, base, offa, mska, offb, mskb, CB)
        r10v = _load_r(r10, rrow, rmask, HAS_R)
    c = _cpass_step(x6a, x6b, r6v, ta, tb, ga, gb, lse, c, D,
                    EPS, PIN, CB, HAS_R)
  if NSRC > 7:
    if PF == 1:
      if NSRC > 8:
        x8a, x8b = _load(s8, base, offa, mska, offb, mskb, CB)
        r8v = _load_r(r8, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 9:
        x9a, x9b = _load(s9, base, offa, mska, offb, mskb, CB)
        r9v = _load_r(r9, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 10:
        x10a, x10b = _load(s10, base, offa, mska, offb, mskb, CB)
        r10v = _load_r(r10, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 11:
        x11a, x11b = _load(s11, base, offa, mska, offb, mskb, CB)
        r11v = _load_r(r11, rrow, rmask, HAS_R)
    c = _cpass_step(x7a, x7b, r7v, ta, tb, ga, gb, lse, c, D,
                    EPS, PIN, CB, HAS_R)
  if NSRC > 8:
    if PF == 1:
      if NSRC > 9:
        x9a, x9b = _load(s9, base, offa, mska, offb, mskb, CB)
        r9v = _load_r(r9, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 10:
        x10a, x10b = _load(s10, base, offa, mska, offb, mskb, CB)
        r10v = _load_r(r10, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 11:
        x11a, x11b = _load(s11, base, offa, mska, offb, mskb, CB)
        r11v = _load_r(r11, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 12:
        x12a, x12b = _load(s12, base, offa, mska, offb, mskb, CB)
        r12v = _load_r(r12, rrow, rmask, HAS_R)
    c = _cpass_step(x8a, x8b, r8v, ta, tb, ga, gb, lse, c, D,
                    EPS, PIN, CB, HAS_R)
  if NSRC > 9:
    if PF == 1:
      if NSRC > 10:
        x10a, x10b = _load(s10, base, offa, mska, offb, mskb, CB)
        r10v = _load_r(r10, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 11:
        x11a, x11b = _load(s11, base, offa, mska, offb, mskb, CB)
        r11v = _load_r(r11, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 12:
        x12a, x12b = _load(s12, base, offa, mska, offb, mskb, CB)
        r12v = _load_r(r12, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 13:
        x13a, x13b = _load(s13, base, offa, mska, offb, mskb, CB)
        r13v = _load_r(r13, rrow, rmask, HAS_R)
    c = _cpass_step(x9a, x9b, r9v, ta, tb, ga, gb, lse, c, D,
                    EPS, PIN, CB, HAS_R)
  if NSRC > 10:
    if PF == 1:
      if NSRC > 11:
        x11a, x11b = _load(s11, base, offa, mska, offb, mskb, CB)
        r11v = _load_r(r11, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 12:
        x12a, x12b = _load(s12, base, offa, mska, offb, mskb, CB)
        r12v = _load_r(r12, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 13:
        x13a, x13b = _load(s13, base, offa, mska, offb, mskb, CB)
        r13v = _load_r(r13, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 14:
        x14a, x14b = _load(s14, base, offa, mska, offb, mskb, CB)
        r14v = _load_r(r14, rrow, rmask, HAS_R)
    c = _cpass_step(x10a, x10b, r10v, ta, tb, ga, gb, lse, c, D,
                    EPS, PIN, CB, HAS_R)
  if NSRC > 11:
    if PF == 1:
      if NSRC > 12:
        x12a, x12b = _load(s12, base, offa, mska, offb, mskb, CB)
        r12v = _load_r(r12, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 13:
        x13a, x13b = _load(s13, base, offa, mska, offb, mskb, CB)
        r13v = _load_r(r13, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 14:
        x14a, x14b = _load(s14, base, offa, mska, offb, mskb, CB)
        r14v = _load_r(r14, rrow, rmask, HAS_R)
    if PF == 4:
      if NSRC > 15:
        x15a, x15b = _load(s15, base, offa, mska, offb, mskb, CB)
        r15v = _load_r(r15, rrow, rmask, HAS_R)
    c = _cpass_step(x11a, x11b, r11v, ta, tb, ga, gb, lse, c, D,
                    EPS, PIN, CB, HAS_R)
  if NSRC > 12:
    if PF == 1:
      if NSRC > 13:
        x13a, x13b = _load(s13, base, offa, mska, offb, mskb, CB)
        r13v = _load_r(r13, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 14:
        x14a, x14b = _load(s14, base, offa, mska, offb, mskb, CB)
        r14v = _load_r(r14, rrow, rmask, HAS_R)
    if PF == 3:
      if NSRC > 15:
        x15a, x15b = _load(s15, base, offa, mska, offb, mskb, CB)
        r15v = _load_r(r15, rrow, rmask, HAS_R)
    c = _cpass_step(x12a, x12b, r12v, ta, tb, ga, gb, lse, c, D,
                    EPS, PIN, CB, HAS_R)
  if NSRC > 13:
    if PF == 1:
      if NSRC > 14:
        x14a, x14b = _load(s14, base, offa, mska, offb, mskb, CB)
        r14v = _load_r(r14, rrow, rmask, HAS_R)
    if PF == 2:
      if NSRC > 15:
        x15a, x15b = _load(s15, base, offa, mska, offb, mskb, CB)
        r15v = _load_r(r15, rrow, rmask, HAS_R)
    c = _cpass_step(x13a, x13b, r13v, ta, tb, ga, gb, lse, c, D,
                    EPS, PIN, CB, HAS_R)
  if NSRC > 14:
    if PF == 1:
      if NSRC > 15:
        x15a, x15b = _load(s15, base, offa, mska, offb, mskb, CB)
        r15v = _load_r(r15, rrow, rmask, HAS_R)
    c = _cpass_step(x14a, x14b, r14v, ta, tb, ga, gb, lse, c, D,
                    EPS, PIN, CB, HAS_R)
  if NSRC > 15:
    c = _cpass_step(x15a, x15b, r15v, ta, tb, ga, gb, lse, c, D,
                    EPS, PIN, CB, HAS_R)
  # </gen:CPASS_STEPS>
  tl.store(c_out + hbase + hoff, c, mask=hmask)


@triton.jit
def _bwd_step(xa, xb, r, ds_ptr, base, offa, mska, offb, mskb, ta, tb, ga,
              gb, lse, c, dta, dtb, D: tl.constexpr, EPS: tl.constexpr,
              CB: tl.constexpr, HAS_R: tl.constexpr):
  """Writes ``ds_i`` for one tile; returns ``dt + du_i * s_i`` (both parts)
  (``r``: see :func:`_logits_r`)."""
  xa, xb, r, u, logit = _logits_r(xa, xb, r, ta, tb, D, EPS, CB, HAS_R)
  w = tl.exp(logit - lse)
  dw = _hsum(ga * xa, gb * xb, CB)
  dl = w * (dw - c)
  du = dl * r[:, None]
  dr = tl.sum(dl * u, axis=1)
  coef = (dr * r * r * r / D)[:, None, None]
  w3 = w[:, :, None]
  du3 = du[:, :, None]
  dsa = w3 * ga + du3 * ta[None, :, :] - coef * xa
  dsb = w3 * gb + du3 * tb[None, :, :] - coef * xb
  _store(ds_ptr, base, offa, mska, offb, mskb, dsa, dsb, CB)
  dta += du3 * xa
  if CB > 0:
    dtb += du3 * xb
  return dta, dtb


@triton.jit
def _bwd_kernel(
    # <gen:BWD_SRC_PARAMS>
    s0, s1, s2, s3, s4, s5, s6, s7,
    s8, s9, s10, s11, s12, s13, s14, s15,
    r0, r1, r2, r3, r4, r5, r6, r7,
    r8, r9, r10, r11, r12, r13, r14, r15,
    # </gen:BWD_SRC_PARAMS>
    g_ptr, t_ptr, lse_ptr, c_ptr,
    # <gen:BWD_INIT_PARAMS>
    i0, i1, i2, i3, i4, i5, i6, i7,
    i8, i9, i10, i11, i12, i13, i14, i15,
    # </gen:BWD_INIT_PARAMS>
    i_dt,
    N, NTILES,
    # <gen:BWD_OUT_PARAMS>
    ds0, ds1, ds2, ds3, ds4, ds5, ds6, ds7,
    ds8, ds9, ds10, ds11, ds12, ds13, ds14, ds15,
    # </gen:BWD_OUT_PARAMS>
    dt_ptr,
    NSRC: tl.constexpr, PF: tl.constexpr, HAS_R: tl.constexpr,
    D: tl.constexpr, H: tl.constexpr, C: tl.constexpr, HP: tl.constexpr,
    CA: tl.constexpr, CB: tl.constexpr, BN: tl.constexpr,
    EPS: tl.constexpr):
  """Backward pass 2 (persistent grid of P programs over cdiv(N, BN) tiles).

  Inputs: ``s*`` ``[N, D]``; with HAS_R ``r*`` ``[N]`` fp32 (as for the
  c-pass); ``g_ptr`` ``[N, D]``, ``t_ptr`` ``[D]``, ``lse_ptr`` and ``c_ptr``
  ``[N, H]`` fp32. Outputs: ``ds*`` ``[N, D]`` in
  the sources' dtype (d source_i) and ``dt_ptr`` ``[P, D]`` fp32, each
  program's partial sum of ``du_i * s_i`` over its tokens and sources.
  """
  pid = tl.program_id(0)
  nprog = tl.num_programs(0)
  cola, cmska, colb, cmskb = _cols(H, C, HP, CA, CB)
  ta, tb = _load(t_ptr, 0, cola, cmska, colb, cmskb, CB)
  dta, dtb = _zeros(BN, HP, CA, CB)
  for k in range(0, tl.cdiv(NTILES - pid, nprog)):
    tile = pid + k * nprog
    base, offa, mska, offb, mskb, hbase, hoff, hmask = _rows(
        tile, N, cola, cmska, colb, cmskb, D, H, HP, BN)
    rrow, rmask = _token_ids(tile, N, BN)
    ga, gb = _load(g_ptr, base, offa, mska, offb, mskb, CB)
    ga = ga.to(tl.float32)
    gb = gb.to(tl.float32)
    lse = tl.load(lse_ptr + hbase + hoff, mask=hmask, other=0.0)
    c = tl.load(c_ptr + hbase + hoff, mask=hmask, other=0.0)
    # <gen:BWD_STEPS>
    if PF > 0:
      if NSRC > 0:
        x0a, x0b = _load(s0, base, offa, mska, offb, mskb, CB)
        r0v = _load_r(r0, rrow, rmask, HAS_R)
    if PF > 1:
      if NSRC > 1:
        x1a, x1b = _load(s1, base, offa, mska, offb, mskb, CB)
        r1v = _load_r(r1, rrow, rmask, HAS_R)
    if PF > 2:
      if NSRC > 2:
        x2a, x2b = _load(s2, base, offa, mska, offb, mskb, CB)
        r2v = _load_r(r2, rrow, rmask, HAS_R)
    if PF > 3:
      if NSRC > 3:
        x3a, x3b = _load(s3, base, offa, mska, offb, mskb, CB)
        r3v = _load_r(r3, rrow, rmask, HAS_R)
    if NSRC > 0:
      if PF == 1:
        if NSRC > 1:
          x1a, x1b = _load(s1, base, offa, mska, offb, mskb, CB)
          r1v = _load_r(r1, rrow, rmask, HAS_R)
      if PF == 2:
        if NSRC > 2:
          x2a, x2b = _load(s2, base, offa, mska, offb, mskb, CB)
          r2v = _load_r(r2, rrow, rmask, HAS_R)
      if PF == 3:
        if NSRC > 3:
          x3a, x3b = _load(s3, base, offa, mska, offb, mskb, CB)
          r3v = _load_r(r3, rrow, rmask, HAS_R)
      if PF == 4:
        if NSRC > 4:
          x4a, x4b = _load(s4, base, offa, mska, offb, mskb, CB)
          r4v = _load_r(r4, rrow, rmask, HAS_R)
      dta, dtb = _bwd_step(x0a, x0b, r0v, ds0, base, offa,
                           mska, offb, mskb, ta, tb, ga, gb, lse, c,
                           dta, dtb, D, EPS, CB, HAS_R)
    if NSRC > 1:
      if PF == 1:
        if NSRC > 2:
          x2a, x2b = _load(s2, base, offa, mska, offb, mskb, CB)
          r2v = _load_r(r2, rrow, rmask, HAS_R)
      if PF == 2:
        if NSRC > 3:
          x3a, x3b = _load(s3, base, offa, mska, offb, mskb, CB)
          r3v = _load_r(r3, rrow, rmask, HAS_R)
      if PF == 3:
        if NSRC > 4:
          x4a, x4b = _load(s4, base, offa, mska, offb, mskb, CB)
          r4v = _load_r(r4, rrow, rmask, HAS_R)
      if PF == 4:
        if NSRC > 5:
          x5a, x5b = _load(s5, base, offa, mska, offb, mskb, CB)
          r5v = _load_r(r5, rrow, rmask, HAS_R)
      dta, dtb = _bwd_step(x1a, x1b, r1v, ds1, base, offa,
                           mska, offb, mskb, ta, tb, ga, gb, lse, c,
                           dta, dtb, D, EPS, CB, HAS_R)
    if NSRC > 2:
      if PF == 1:
        if NSRC > 3:
          x3a, x3b = _load(s3, base, offa, mska, offb, mskb, CB)
          r3v = _load_r(r3, rrow, rmask, HAS_R)
      if PF == 2:
        if NSRC > 4:
          x4a, x4b = _load(s4, base, offa, mska, offb, mskb, CB)
          r4v = _load_r(r4, rrow, rmask, HAS_R)
      if PF == 3:
        if NSRC > 5:
          x5a, x5b = _load(s5, base, offa, mska, offb, mskb, CB)
          r5v = _load_r(r5, rrow, rmask, HAS_R)
      if PF == 4:
        if NSRC > 6:
          x6a, x6b = _load(s6, base, offa, mska, offb, mskb, CB)
          r6v = _load_r(r6, rrow, rmask, HAS_R)
      dta, dtb = _bwd_step(x2a, x2b, r2v, ds2, base, offa,
                           mska, offb, mskb, ta, tb, ga, gb, lse, c,
                           dta, dtb, D, EPS, CB, HAS_R)
    if NSRC > 3:
      if PF == 1:
        if NSRC > 4:
          x4a, x4b = _load(s4, base, offa, mska, offb, mskb, CB)
          r4v = _load_r(r4, rrow, rmask, HAS_R)
      if PF == 2:
        if NSRC > 5:
          x5a, x5b = _load(s5, base, offa, mska, offb, mskb, CB)
          r5v = _load_r(r5, rrow, rmask, HAS_R)
      if PF == 3:
        if NSRC > 6:
          x6a, x6b = _load(s6, base, offa, mska, offb, mskb, CB)
          r6v = _load_r(r6, rrow, rmask, HAS_R)
      if PF == 4:
        if NSRC > 7:
          x7a, x7b = _load(s7, base, offa, mska, offb, mskb, CB)
          r7v = _load_r(r7, rrow, rmask, HAS_R)
      dta, dtb = _bwd_step(x3a, x3b, r3v, ds3, base, offa,
                           mska, offb, mskb, ta, tb, ga, gb, lse, c,
                           dta, dtb, D, EPS, CB, HAS_R)
    if NSRC > 4:
      if PF == 1:
        if NSRC > 5:
          x5a, x5b = _load(s5, base, offa, mska, offb, mskb, CB)
          r5v = _load_r(r5, rrow, rmask, HAS_R)
      if PF == 2:
        if NSRC > 6:
          x6a, x6b = _load(s6, base, offa, mska, offb, mskb, CB)
          r6v = _load_r(r6, rrow, rmask, HAS_R)
      if PF == 3:
        if NSRC > 7:
          x7a, x7b = _load(s7, base, offa, mska, offb, mskb, CB)
          r7v = _load_r(r7, rrow, rmask, HAS_R)
      if PF == 4:
        if NSRC > 8:
          x8a, x8b = _load(s8, base, offa, mska, offb, mskb, CB)
          r8v = _load_r(r8, rrow, rmask, HAS_R)
      dta, dtb = _bwd_step(x4a, x4b, r4v, ds4, base, offa,
                           mska, offb, mskb, ta, tb, ga, gb, lse, c,
                           dta, dtb, D, EPS, CB, HAS_R)
    if NSRC > 5:
      if PF == 1:
        if NSRC > 6:
          x6a, x6b = _load(s6, base, offa, mska, offb, mskb, CB)
          r6v = _load_r(r6, rrow, rmask, HAS_R)
      if PF == 2:
        if NSRC > 7:
          x7a, x7b = _load(s7, base, offa, mska, offb, mskb, CB)
          r7v = _load_r(r7, rrow, rmask, HAS_R)
      if PF == 3:
        if NSRC > 8:
          x8a, x8b = _load(s8, base, offa, mska, offb, mskb, CB)
          r8v = _load_r(r8, rrow, rmask, HAS_R)
      if PF == 4:
        if NSRC > 9:
          x9a, x9b = _load(s9, base, offa, mska, offb, mskb, CB)
          r9v = _load_r(r9, rrow, rmask, HAS_R)
      dta, dtb = _bwd_step(x5a, x5b, r5v, ds5, base, offa,
                           mska, offb, mskb, ta, tb, ga, gb, lse, c,
                           dta, dtb, D, EPS, CB, HAS_R)
    if NSRC > 6:
      if PF == 1:
        if NSRC > 7:
          x7a, x7b = _load(s7, base, offa, mska, offb, mskb, CB)
          r7v = _load_r(r7, rrow, rmask, HAS_R)
      if PF == 2:
        if NSRC > 8:
          x8a, x8b = _load(s8, base, offa, mska, offb, mskb, CB)
          r8v = _load_r(r8, rrow, rmask, HAS_R)
      if PF == 3:
        if NSRC > 9:
          x9a, x9b = _load(s9, base, offa, mska, offb, mskb, CB)
          r9v = _load_r(r9, rrow, rmask, HAS_R)
      if PF == 4:
        if NSRC > 10:
          x10a, x10b = _load(s10, base, offa, mska, offb, mskb, CB)
          r10v = _load_r(r10, rrow, rmask, HAS_R)
      dta, dtb = _bwd_step(x6a, x6b, r6v, ds6, base, offa,
                           mska, offb, mskb, ta, tb, ga, gb, lse, c,
                           dta, dtb, D, EPS, CB, HAS_R)
    if NSRC > 7:
      if PF == 1:
        if NSRC > 8:
          x8a, x8b = _load(s8, base, offa, mska, offb, mskb, CB)
          r8v = _load_r(r8, rrow, rmask, HAS_R)
      if PF == 2:
        if NSRC > 9:
          x9a, x9b = _load(s9, base, offa, mska, offb, mskb, CB)
          r9v = _load_r(r9, rrow, rmask, HAS_R)
      if PF == 3:
        if NSRC > 10:
          x10a, x10b = _load(s10, base, offa, mska, offb, mskb, CB)
          r10v = _load_r(r10, rrow, rmask, HAS_R)
      if PF == 4:
        if NSRC > 11:
          x11a, x11b = _load(s11, base, offa, mska, offb, mskb, CB)
          r11v = _load_r(r11, rrow, rmask, HAS_R)
      dta, dtb = _bwd_step(x7a, x7b, r7v, ds7, base, offa,
                           mska, offb, mskb, ta, tb, ga, gb, lse, c,
                           dta, dtb, D, EPS, CB, HAS_R)
    if NSRC > 8:
      if PF == 1:
        if NSRC > 9:
          x9a, x9b = _load(s9, base, offa, mska, offb, mskb, CB)
          r9v = _load_r(r9, rrow, rmask, HAS_R)
      if PF == 2:
        if NSRC > 10:
          x10a, x10b = _load(s10, base, offa, mska, offb, mskb, CB)
          r10v = _load_r(r10, rrow, rmask, HAS_R)
      if PF == 3:
        if NSRC > 11:
          x11a, x11b = _load(s11, base, offa, mska, offb, mskb, CB)
          r11v = _load_r(r11, rrow, rmask, HAS_R)
      if PF == 4:
        if NSRC > 12:
          x12a, x12b = _load(s12, base, offa, mska, offb, mskb, CB)
          r12v = _load_r(r12, rrow, rmask, HAS_R)
      dta, dtb = _bwd_step(x8a, x8b, r8v, ds8, base, offa,
                           mska, offb, mskb, ta, tb, ga, gb, lse, c,
                           dta, dtb, D, EPS, CB, HAS_R)
    if NSRC > 9:
      if PF == 1:
        if NSRC > 10:
          x10a, x10b = _load(s10, base, offa, mska, offb, mskb, CB)
          r10v = _load_r(r10, rrow, rmask, HAS_R)
      if PF == 2:
        if NSRC > 11:
          x11a, x11b = _load(s11, base, offa, mska, offb, mskb, CB)
          r11v = _load_r(r11, rrow, rmask, HAS_R)
      if PF == 3:
        if NSRC > 12:
          x12a, x12b = _load(s12, base, offa, mska, offb, mskb, CB)
          r12v = _load_r(r12, rrow, rmask, HAS_R)
      if PF == 4:
        if NSRC > 13:
          x13a, x13b = _load(s13, base, offa, mska, offb, mskb, CB)
          r13v = _load_r(r13, rrow, rmask, HAS_R)
      dta, dtb = _bwd_step(x9a, x9b, r9v, ds9, base, offa,
                           mska, offb, mskb, ta, tb, ga, gb, lse, c,
                           dta, dtb, D, EPS, CB, HAS_R)
    if NSRC > 10:
      if PF == 1:
        if NSRC > 11:
          x11a, x11b = _load(s11, base, offa, mska, offb, mskb, CB)
          r11v = _load_r(r11, rrow, rmask, HAS_R)
      if PF == 2:
        if NSRC > 12:
          x12a, x12b = _load(s12, base, offa, mska, offb, mskb, CB)
          r12v = _load_r(r12, rrow, rmask, HAS_R)
      if PF == 3:
        if NSRC > 13:
          x13a, x13b = _load(s13, base, offa, mska, offb, mskb, CB)
          r13v = _load_r(r13, rrow, rmask, HAS_R)
      if PF == 4:
        if NSRC > 14:
          x14a, x14b = _load(s14, base, offa, mska, offb, mskb, CB)
          r14v = _load_r(r14, rrow, rmask, HAS_R)
      dta, dtb = _bwd_step(x10a, x10b, r10v, ds10, base, offa,
                           mska, offb, mskb, ta, tb, ga, gb, lse, c,
                           dta, dtb, D, EPS, CB, HAS_R)
    if NSRC > 11:
      if PF == 1:
        if NSRC > 12:
          x12a, x12b = _load(s12, base, offa, mska, offb, mskb, CB)
          r12v = _load_r(r12, rrow, rmask, HAS_R)
      if PF == 2:
        if NSRC > 13:
          x13a, x13b = _load(s13, base, offa, mska, offb, mskb, CB)
          r13v = _load_r(r13, rrow, rmask, HAS_R)
      if PF == 3:
        if NSRC > 14:
          x14a, x14b = _load(s14, base, offa, mska, offb, mskb, CB)
          r14v = _load_r(r14, rrow, rmask, HAS_R)
      if PF == 4:
        if NSRC > 15:
          x15a, x15b = _load(s15, base, offa, mska, offb, mskb, CB)
          r15v = _load_r(r15, rrow, rmask, HAS_R)
      dta, dtb = _bwd_step(x11a, x11b, r11v, ds11, base, offa,
                           mska, offb, mskb, ta, tb, ga, gb, lse, c,
                           dta, dtb, D, EPS, CB, HAS_R)
    if NSRC > 12:
      if PF == 1:
        if NSRC > 13:
          x13a, x13b = _load(s13, base, offa, mska, offb, mskb, CB)
          r13v = _load_r(r13, rrow, rmask, HAS_R)
      if PF == 2:
        if NSRC > 14:
          x14a, x14b = _load(s14, base, offa, mska, offb, mskb, CB)
          r14v = _load_r(r14, rrow, rmask, HAS_R)
      if PF == 3:
        if NSRC > 15:
          x15a, x15b = _load(s15, base, offa, mska, offb, mskb, CB)
          r15v = _load_r(r15, rrow, rmask, HAS_R)
      dta, dtb = _bwd_step(x12a, x12b, r12v, ds12, base, offa,
                           mska, offb, mskb, ta, tb, ga, gb, lse, c,
                           dta, dtb, D, EPS, CB, HAS_R)
    if NSRC > 13:
      if PF == 1:
        if NSRC > 14:
          x14a, x14b = _load(s14, base, offa, mska, offb, mskb, CB)
          r14v = _load_r(r14, rrow, rmask, HAS_R)
      if PF == 2:
        if NSRC > 15:
          x15a, x15b = _load(s15, base, offa, mska, offb, mskb, CB)
          r15v = _load_r(r15, rrow, rmask, HAS_R)
      dta, dtb = _bwd_step(x13a, x13b, r13v, ds13, base, offa,
                           mska, offb, mskb, ta, tb, ga, gb, lse, c,
                           dta, dtb, D, EPS, CB, HAS_R)
    if NSRC > 14:
      if PF == 1:
        if NSRC > 15:
          x15a, x15b = _load(s15, base, offa, mska, offb, mskb, CB)
          r15v = _load_r(r15, rrow, rmask, HAS_R)
      dta, dtb = _bwd_step(x14a, x14b, r14v, ds14, base, offa,
                           mska, offb, mskb, ta, tb, ga, gb, lse, c,
                           dta, dtb, D, EPS, CB, HAS_R)
    if NSRC > 15:
      dta, dtb = _bwd_step(x15a, x15b, r15v, ds15, base, offa,
                           mska, offb, mskb, ta, tb, ga, gb, lse, c,
                           dta, dtb, D, EPS, CB, HAS_R)
    # </gen:BWD_STEPS>
  _store(dt_ptr, pid * D, cola, cmska, colb, cmskb, tl.sum(dta, axis=0),
         tl.sum(dtb, axis=0), CB)


# -----------------------------------------------------------------------------
# Launch plumbing
# -----------------------------------------------------------------------------


def _pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def head_parts(c: int) -> tuple[int, int]:
  """``(CA, CB)``: a head of ``c`` channels as two power-of-two parts, CA the
  largest power of two <= c and CB = pow2(c - CA) (0 when c is one): 160 ->
  (128, 32), 96 -> (64, 32), 128 -> (128, 0). Pads at most c - CA lanes."""
  ca = 1 << (c.bit_length() - 1)
  return ca, (_pow2(c - ca) if c > ca else 0)


def tile_meta(d: int, h: int) -> dict:
  """The tile constexprs ``D, H, C, HP, CA, CB`` of every kernel here."""
  c = d // h
  ca, cb = head_parts(c)
  return dict(D=d, H=h, C=c, HP=_pow2(h), CA=ca, CB=cb)


def tile_width(d: int, h: int) -> int:
  """Lanes of one token's tile: ``HP * (CA + CB)`` (``>= D``)."""
  ca, cb = head_parts(d // h)
  return _pow2(h) * (ca + cb)


@dataclasses.dataclass(frozen=True)
class _Cfg:
  """Static description of one routing call (hashable: a custom_vjp nondiff)."""
  d: int
  h: int
  eps: float
  exact_bwd: bool
  poison: bool
  chunk: int
  fwd_bn: int
  fwd_warps: int
  fwd_pf: int
  fwd_given_r: bool                # see TUNING
  bwd_given_r: bool                # see TUNING
  cpass_bn: int
  cpass_warps: int
  cpass_pf: int
  bwd_bn: int
  bwd_warps: int
  bwd_pf: int
  bwd_programs: int
  pin: bool = True                 # see _pin
  mesh: object = None              # AbstractMesh, or None: call directly
  batch_axes: tuple = ()           # mesh axes splitting the first leading dim

  @property
  def c(self):
    return self.d // self.h

  def meta(self, bn):
    return dict(tile_meta(self.d, self.h), BN=bn, EPS=float(self.eps))


def _tokens_per_program(padded_width: int, elems_per_thread: int,
                        warps: int) -> int:
  """Largest power of two BN with BN * width <= elems * threads, in [1, 64]."""
  bn = max(1, elems_per_thread * 32 * warps // padded_width)
  return min(64, 1 << (bn.bit_length() - 1))


def _num_sms() -> int:
  try:
    return int(getattr(jax.devices()[0], "core_count", 132) or 132)
  except Exception:  # pragma: no cover
    return 132


def _pf(x) -> int:
  x = int(x)
  if not 1 <= x <= 4:
    raise ValueError(f"prefetch depth {x} must be in 1..4")
  return x


def _make_cfg(d, h, eps, exact_bwd, mesh, batch_axes) -> _Cfg:
  tu = TUNING
  width = tile_width(d, h)
  chunk = int(min(max(1, CHUNK), MAX_SOURCES_PER_LAUNCH))
  return _Cfg(
      d=d, h=h, eps=float(eps), exact_bwd=bool(exact_bwd), poison=POISON,
      chunk=chunk,
      fwd_bn=_tokens_per_program(width, tu["fwd_elems_per_thread"],
                                 tu["fwd_warps"]),
      fwd_warps=tu["fwd_warps"], fwd_pf=_pf(tu["fwd_prefetch"]),
      fwd_given_r=bool(tu["fwd_given_r"]),
      bwd_given_r=bool(tu["bwd_given_r"]),
      cpass_bn=_tokens_per_program(width, tu["cpass_elems_per_thread"],
                                   tu["cpass_warps"]),
      cpass_warps=tu["cpass_warps"], cpass_pf=_pf(tu["cpass_prefetch"]),
      bwd_bn=_tokens_per_program(width, tu["bwd_elems_per_thread"],
                                 tu["bwd_warps"]),
      bwd_warps=tu["bwd_warps"], bwd_pf=_pf(tu["bwd_prefetch"]),
      bwd_programs=max(1, _num_sms() * tu["bwd_programs_per_sm"]),
      pin=PIN_ACCUMULATORS,
      mesh=mesh, batch_axes=tuple(batch_axes))


def _launch(kernel, inputs, scalars, out_shapes, *, grid, num_warps,
            carry=None, poison=False, dummy=None, **meta):
  """``triton_call`` with the signature convention of the kernels above.

  The kernel's parameters are ``inputs``, then one unused "init" pointer per
  output, then ``scalars``, then the outputs, then the constexprs ``meta``.
  ``carry`` maps output index -> input index to alias (in-place state). In
  poison mode every other output gets a NaN-filled init buffer aliased to it.
  """
  carry = dict(carry or {})
  aliases = {}
  inits = []
  n_in = len(inputs)
  for j, shp in enumerate(out_shapes):
    if j in carry:
      aliases[carry[j]] = j
      inits.append(dummy)
    elif poison and math.prod(shp.shape) > 1:
      inits.append(jnp.full(shp.shape, jnp.nan, shp.dtype))
      aliases[n_in + j] = j
    else:
      inits.append(dummy)
  _use_ptx_cache()
  target = "triton_kernel_call"
  if TUNING["ffi_launch"]:
    _use_ffi_lowering()
    target = FFI_TARGET
  return jt.triton_call(
      *inputs, *inits, *scalars, kernel=kernel, out_shape=list(out_shapes),
      grid=grid, num_warps=num_warps, num_stages=1,
      input_output_aliases=aliases, custom_call_target_name=target, **meta)


FFI_TARGET = "triton_kernel_call_ffi"


def _ptx_cached(compile_fn):
  """``compile_fn`` (jax-triton's Triton -> PTX compile) through
  :func:`mhar_jax.kernels.ptx_cache.cached`: cached under JAX's persistent
  compilation cache directory when one is set, and not while jax-triton dumps
  each compile's IR (``JAX_TRITON_DUMP_DIR``; cached results carry none)."""
  def cache_dir():
    if getattr(jt.triton_lib, "_JAX_TRITON_DUMP_DIR", None):
      return None
    return jax.config.jax_compilation_cache_dir
  return ptx_cache.cached(compile_fn, jt.triton_lib.CompilationResult,
                          cache_dir, (triton.__version__, jt.__version__))


@functools.cache
def _use_ptx_cache():
  """Makes jax-triton's compiles go through :func:`_ptx_cached` (once)."""
  jt.triton_lib.compile_ttir_inplace = _ptx_cached(
      jt.triton_lib.compile_ttir_inplace)


@functools.cache
def _use_ffi_lowering():
  """Registers :func:`_ffi_lowering` as the CUDA lowering of jax-triton's
  primitive (once; calls for the legacy target lower as before)."""
  jt_lowering = functools.partial(jt.triton_lib.triton_kernel_call_lowering,
                                  jt.triton_lib.get_cuda_backend)
  mlir.register_lowering(jt.triton_lib.triton_kernel_call_p,
                         functools.partial(_ffi_lowering, jt_lowering),
                         platform="cuda")


def _ffi_lowering(jt_lowering, ctx, *args, custom_call_target_name,
                  **params):
  """jax-triton's CUDA lowering of a Triton call; for the target
  ``FFI_TARGET``, its custom call re-encoded as jaxlib's typed-FFI handler
  reads it: API version 4, the compressed kernel-call proto (jax-triton's
  legacy ``backend_config``) as the string attribute ``opaque``."""
  outs = jt_lowering(ctx, *args,
                     custom_call_target_name=custom_call_target_name,
                     **params)
  if custom_call_target_name == FFI_TARGET:
    ir = mlir.ir
    op = outs[0].owner
    attrs = getattr(op, "operation", op).attributes
    attrs["backend_config"] = ir.DictAttr.get(
        {"opaque": attrs["backend_config"]})
    attrs["api_version"] = ir.IntegerAttr.get(
        ir.IntegerType.get_signless(32), 4)
  return outs


def _chunks(seq, k):
  return [seq[i:i + k] for i in range(0, len(seq), k)]


def _pad_slots(chunk):
  return list(chunk) + [chunk[0]] * (MAX_SOURCES_PER_LAUNCH - len(chunk))


def _r_chunks(srcs, rs, cfg: _Cfg):
  """The sources and their inverse RMS slots (the sources again when ``rs``
  is None: unread), in launches of ``cfg.chunk``."""
  chunks = _chunks(list(srcs), cfg.chunk)
  return zip(chunks, chunks if rs is None else _chunks(list(rs), cfg.chunk))


def _fwd_local(srcs, t, cfg: _Cfg, init=None, rs=None, write_r=False):
  """Routes ``srcs`` (tuple of ``[N, D]``) for G sites at once.

  ``rs``: None, or the sources' inverse RMS (tuple of ``[N]`` fp32, e.g.
  :func:`reference.inv_rms`), read instead of computed in the kernel when
  ``cfg.fwd_given_r``. ``write_r`` (G = 1, ``rs`` not read): also return the
  inverse RMS the kernel computed, ``[S, N]`` fp32, as a third output.

  ``t``: ``[G, D]`` fp32, each site's query * gain. ``init``: None, or
  ``(out, lse, i0)`` (``[R, N, D]``, ``[R, N, H]`` fp32, an int): site ``g``
  continues the routed result in row ``i0 + g`` over earlier sources (the
  result is as if those sources came first in ``srcs``). Returns
  ``(out [G, N, D]`` in the sources' dtype, ``lse [G, N, H]`` fp32).
  """
  n, d = srcs[0].shape
  g = t.shape[0]
  h = cfg.h
  dtype = srcs[0].dtype
  f32 = jnp.float32
  bn = cfg.fwd_bn
  grid = (g * triton.cdiv(n, bn),)
  one = jax.ShapeDtypeStruct((1,), f32)
  if not cfg.fwd_given_r or write_r:
    rs = None
  if write_r and g != 1:
    raise ValueError(f"_fwd_local: write_r needs one site, got {g}")
  launches = list(_r_chunks(srcs, rs, cfg))
  i0 = 0
  if init is None:
    state, mode = (t, t, t), 0
  else:
    state, mode, i0 = (init[1], t, init[0]), 2, int(init[2])
  k = MAX_SOURCES_PER_LAUNCH
  r_out = []
  for ci, (ch, rch) in enumerate(launches):
    last = ci == len(launches) - 1
    inputs = _pad_slots(ch) + _pad_slots(rch) + [t, *state]
    shapes = [
        jax.ShapeDtypeStruct((g, n, d), dtype) if last else one,
        jax.ShapeDtypeStruct((g, n, h), f32) if last else one,
        one if last else jax.ShapeDtypeStruct((g, n, h), f32),
        one if last else jax.ShapeDtypeStruct((g, n, h), f32),
        one if last else jax.ShapeDtypeStruct((g, n, d), f32),
        jax.ShapeDtypeStruct((len(ch), n), f32) if write_r else one,
    ]
    carry = ({2: 2 * k + 1, 3: 2 * k + 2, 4: 2 * k + 3}
             if mode == 1 and not last else {})
    res = _launch(_fwd_kernel, inputs, [n, i0], shapes, grid=grid,
                  num_warps=cfg.fwd_warps, carry=carry, poison=cfg.poison,
                  dummy=t, NSRC=len(ch), INIT=mode, LAST=last,
                  HAS_R=rs is not None, WRITE_R=write_r, G=g,
                  PF=cfg.fwd_pf, PIN=cfg.pin,
                  **cfg.meta(bn))
    if write_r:
      r_out.append(res[5])
    if last:
      return (res[0], res[1], *([jnp.concatenate(r_out)] if write_r else []))
    state, mode = (res[2], res[3], res[4]), 1
  raise AssertionError("unreachable")


def _cpass_local(srcs, g, t, lse, cfg: _Cfg, rs=None):
  """``c = sum_i w_i <g, s_i>_h``, ``[N, H]`` fp32; ``rs``: None or the
  sources' inverse RMS (tuple of ``[N]`` fp32), read instead of computed."""
  n, _ = srcs[0].shape
  bn = cfg.cpass_bn
  grid = (triton.cdiv(n, bn),)
  k = MAX_SOURCES_PER_LAUNCH
  c = None
  for ci, (ch, rch) in enumerate(_r_chunks(srcs, rs, cfg)):
    first = ci == 0
    inputs = _pad_slots(ch) + _pad_slots(rch) + [g, t, lse, t if first else c]
    (c,) = _launch(_cpass_kernel, inputs, [n],
                   [jax.ShapeDtypeStruct((n, cfg.h), jnp.float32)],
                   grid=grid, num_warps=cfg.cpass_warps,
                   carry={} if first else {0: 2 * k + 3}, poison=cfg.poison,
                   dummy=t, NSRC=len(ch), FIRST=first, PF=cfg.cpass_pf,
                   PIN=cfg.pin, HAS_R=rs is not None,
                   **cfg.meta(bn))
  return c


def _bwd_local(srcs, g, t, lse, c, cfg: _Cfg, rs=None):
  """Returns ``(ds tuple of [N, D], dt [D] fp32)`` (dt local to this shard);
  ``rs`` as for :func:`_cpass_local`."""
  n, d = srcs[0].shape
  bn = cfg.bwd_bn
  ntiles = triton.cdiv(n, bn)
  progs = min(ntiles, cfg.bwd_programs)
  dts = []
  ds = []
  for ch, rch in _r_chunks(srcs, rs, cfg):
    inputs = _pad_slots(ch) + _pad_slots(rch) + [g, t, lse, c]
    k = MAX_SOURCES_PER_LAUNCH
    shapes = ([jax.ShapeDtypeStruct((n, d), srcs[0].dtype)] * len(ch)
              + [jax.ShapeDtypeStruct((1,), jnp.float32)] * (k - len(ch))
              + [jax.ShapeDtypeStruct((progs, d), jnp.float32)])
    res = _launch(_bwd_kernel, inputs, [n, ntiles], shapes, grid=(progs,),
                  num_warps=cfg.bwd_warps, poison=cfg.poison, dummy=t,
                  NSRC=len(ch), PF=cfg.bwd_pf, HAS_R=rs is not None,
                  **cfg.meta(bn))
    ds.extend(res[:len(ch)])
    dts.append(jnp.sum(res[-1], axis=0))
  return tuple(ds), functools.reduce(jnp.add, dts)


# -----------------------------------------------------------------------------
# custom_vjp and sharding
# -----------------------------------------------------------------------------


def _shard(cfg: _Cfg, fn, in_specs, out_specs):
  if cfg.mesh is None:
    return fn
  return jax.shard_map(fn, mesh=cfg.mesh, in_specs=in_specs,
                       out_specs=out_specs, check_vma=False)


def _tok_spec(cfg: _Cfg, ndim: int):
  """Spec of a ``[tokens..., last]`` array: first dim over the batch axes."""
  from jax.sharding import PartitionSpec as P
  first = None
  if cfg.batch_axes:
    first = cfg.batch_axes if len(cfg.batch_axes) > 1 else cfg.batch_axes[0]
  return P(first, *([None] * (ndim - 1)))


def _flat(x):
  return x.reshape(-1, x.shape[-1])


def _fwd_impl(srcs, t, cfg, init=None, rs=None, write_r=False):
  """Sharded forward of G sites: ``srcs [..., D]``, ``t [G, D]`` ->
  ``(out [G, ..., D], lse [G, ..., H])``; ``init``: None or
  ``(out [R, ..., D], lse [R, ..., H], i0)``, earlier results to continue;
  ``rs``: None or the sources' inverse RMS ``[...]`` fp32 (see
  :func:`_fwd_local`); ``write_r`` (one site): also returns the inverse RMS
  of every source the kernel computed, ``[S, ...]`` fp32."""
  lead = srcs[0].shape[:-1]
  g = t.shape[0]
  i0 = None if init is None else int(init[2])

  def local(srcs, rs, t, *init):
    loc_lead = srcs[0].shape[:-1]
    if init:
      r = init[0].shape[0]
      init = (init[0].reshape(r, -1, cfg.d), init[1].reshape(r, -1, cfg.h),
              i0)
    res = _fwd_local(tuple(_flat(s) for s in srcs), t, cfg, init or None,
                     tuple(r.reshape(-1) for r in rs) if rs else None,
                     write_r)
    return (res[0].reshape(g, *loc_lead, cfg.d),
            res[1].reshape(g, *loc_lead, cfg.h),
            *(x.reshape(-1, *loc_lead) for x in res[2:]))

  from jax.sharding import PartitionSpec as P
  spec = _tok_spec(cfg, len(lead) + 1)
  gspec = P(None, *spec)                  # [G, tokens..., last]
  init = () if init is None else tuple(init[:2])
  rs = () if rs is None else tuple(rs)
  rspec = _tok_spec(cfg, len(lead))       # [tokens...]
  return _shard(cfg, local,
                (tuple(spec for _ in srcs), tuple(rspec for _ in rs), P(),
                 *(gspec for _ in init)),
                (gspec, gspec, *((P(None, *rspec),) if write_r else ())))(
                    tuple(srcs), rs, t, *init)


def _bwd_impl(srcs, g, t, lse, out, cfg, rs=None):
  """Sharded backward -> ``(ds tuple [..., D], dt [D])``; ``rs``: None or
  the sources' inverse RMS ``[S, ...]`` fp32 (the forward's ``write_r``)."""
  lead = srcs[0].shape[:-1]

  def local(srcs, g, t, lse, out, rs):
    loc_lead = srcs[0].shape[:-1]
    fs = tuple(_flat(s) for s in srcs)
    g2, lse2 = _flat(g), lse.reshape(-1, cfg.h)
    rs = None if rs is None else tuple(rs.reshape(len(fs), -1))
    if cfg.exact_bwd:
      c = _cpass_local(fs, g2, t, lse2, cfg, rs)
    else:
      c = jnp.einsum("nhc,nhc->nh",
                     g2.astype(jnp.float32).reshape(-1, cfg.h, cfg.c),
                     _flat(out).astype(jnp.float32).reshape(-1, cfg.h, cfg.c))
    ds, dt = _bwd_local(fs, g2, t, lse2, c, cfg, rs)
    if cfg.mesh is not None and cfg.batch_axes:
      dt = jax.lax.psum(dt, cfg.batch_axes)
    return tuple(x.reshape(*loc_lead, cfg.d) for x in ds), dt

  from jax.sharding import PartitionSpec as P
  spec = _tok_spec(cfg, len(lead) + 1)
  if out is None:
    out = t  # unused in the exact path; a replicated stand-in
    out_spec = P()
  else:
    out_spec = spec
  r_spec = None if rs is None else P(None, *_tok_spec(cfg, len(lead)))
  return _shard(cfg, local,
                (tuple(spec for _ in srcs), spec, P(), spec, out_spec, r_spec),
                (tuple(spec for _ in srcs), P()))(tuple(srcs), g, t, lse, out,
                                                  rs)


def _t(query, norm_scale):
  return query.astype(jnp.float32) * norm_scale.astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _route(srcs, query, norm_scale, cfg):
  return _fwd_impl(srcs, _t(query, norm_scale)[None], cfg)[0][0]


def _route_fwd(srcs, query, norm_scale, cfg):
  out, lse, *rs = _fwd_impl(srcs, _t(query, norm_scale)[None], cfg,
                            write_r=cfg.bwd_given_r)
  return out[0], (srcs, query, norm_scale, lse[0],
                  None if cfg.exact_bwd else out[0], rs[0] if rs else None)


def _route_bwd(cfg, res, g):
  srcs, query, norm_scale, lse, out, rs = res
  t = _t(query, norm_scale)
  ds, dt = _bwd_impl(srcs, g.astype(srcs[0].dtype), t, lse, out, cfg, rs)
  dquery = (dt * norm_scale.astype(jnp.float32)).astype(query.dtype)
  dscale = (dt * query.astype(jnp.float32)).astype(norm_scale.dtype)
  return tuple(ds), dquery, dscale


_route.defvjp(_route_fwd, _route_bwd)


# -----------------------------------------------------------------------------
# Public entry point
# -----------------------------------------------------------------------------

_BATCH_AXIS_NAMES = ("data", "fsdp", "batch", "dp")


def _rule_batch_axes(mesh) -> tuple:
  """Mesh axes for ``activation_batch`` from flax's logical rules, if set."""
  try:
    from flax.core import spmd as core_spmd
    rules = dict(core_spmd.get_logical_axis_rules() or ())
  except Exception:  # pragma: no cover - flax missing or API moved
    rules = {}
  axes = rules.get("activation_batch")
  if axes is None:
    return tuple(a for a in mesh.axis_names if a in _BATCH_AXIS_NAMES)
  return (axes,) if isinstance(axes, str) else tuple(axes)


def _explicit_batch_axes(x) -> tuple | None:
  """Axes sharding dim 0 of ``x`` when its type carries an explicit sharding."""
  try:
    spec = jax.typeof(x).sharding.spec
  except Exception:
    return None
  if not spec or spec[0] is None:
    return None
  return (spec[0],) if isinstance(spec[0], str) else tuple(spec[0])


def sharding_plan(first_source, mesh=None, batch_axes=None):
  """Returns ``(mesh or None, batch_axes)`` for a call on ``first_source``.

  ``mesh`` defaults to the abstract mesh in context; an empty mesh, or one
  whose axes all have size 1, gives ``(None, ())`` (call the kernels
  directly). ``batch_axes`` defaults as described in the module docstring.
  """
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or all(v == 1 for v in mesh.shape.values()):
      return None, ()
  if batch_axes is None:
    batch_axes = _explicit_batch_axes(first_source)
    if batch_axes is None:
      batch_axes = _rule_batch_axes(mesh)
  batch_axes = tuple(a for a in batch_axes if a in mesh.shape)
  size = math.prod(mesh.shape[a] for a in batch_axes)
  if first_source.ndim < 2 or first_source.shape[0] % size:
    batch_axes = ()
  return mesh, batch_axes


def route(sources: reference.Sources, query: jax.Array,
          norm_scale: jax.Array, *, num_heads: int, eps: float = 1e-6,
          exact_bwd: bool = True, mesh=None, batch_axes=None) -> jax.Array:
  """Multi-head depth routing through the Triton kernels.

  Args:
    sources: ``[S, ..., D]`` or a sequence of S arrays ``[..., D]`` (bf16,
      fp16 or fp32; all alike). A list is never stacked; an ``[S, ...]`` array
      is sliced into S operands.
    query, norm_scale: ``[D]``.
    num_heads: H, dividing D.
    eps: RMSNorm epsilon.
    exact_bwd: two-pass exact backward (default) or one pass that takes
      ``sum_i w_i <g, s_i>`` from the saved output (see module docstring).
    mesh, batch_axes: override the sharding plan (:func:`sharding_plan`);
      passing ``mesh`` forces the shard_map path even on one device.

  Returns:
    ``[..., D]`` in the sources' dtype, equal to
    :func:`mhar_jax.kernels.reference.route`.
  """
  srcs = reference.as_source_list(sources)
  d = reference.check_route_args(srcs, query, norm_scale, num_heads)
  if srcs[0].size == 0:
    return jnp.zeros(srcs[0].shape, srcs[0].dtype)
  mesh, axes = sharding_plan(srcs[0], mesh, batch_axes)
  cfg = _make_cfg(d, num_heads, eps, exact_bwd, mesh, axes)
  return _route(tuple(srcs), query, norm_scale, cfg)


class poison_outputs:
  """Context manager: trace routing calls with NaN-poisoned output buffers."""

  def __enter__(self):
    global POISON
    self._old, POISON = POISON, True
    return self

  def __exit__(self, *exc):
    global POISON
    POISON = self._old
    return False
