"""Full-method depth routing around a whole stack of sublayers, differentiated source by source.

A model of ``n`` sublayers routes at ``n + 1`` sites (DESIGN.md §1): site ``j``
reads sources ``s_0 .. s_j`` and its output ``x_j`` feeds sublayer ``j``, whose
output is ``s_{j+1}``; site ``n`` gives the stack's output. :func:`routed_stack`
computes exactly that function (the same as calling :func:`mhar_jax.kernels.route`
at every site), but its backward is organised by **source** instead of by site:

    for i = n .. 0:                       # source i is read by sites j = i .. n
      ds_i = sum_{j >= i}  w_ji * dx_j + r_i * dlogit_ji * (q_j g_j)
                           - (r_i^2 / D) * dlogit_ji * logit_ji * s_i   (per head)
      dlogit_ji = w_ji * (<dx_j, s_i>_h - <dx_j, x_j>_h)
      (d params_{i-1}, dx_{i-1}) = vjp of sublayer i-1 at ds_i

with ``w_ji = exp(logit_ji - lse_j)`` recomputed from the per-site
log-sum-exp saved by the forward. Each source is read once and each site's
cotangent once per source that site reads: the backward moves about as many
bytes as the forward, where one backward per site reads its sources twice and
emits a gradient for each of them that autodiff then sums (DESIGN.md §3).
``<dx_j, x_j>`` uses the site's output as the forward rounded it (the same
choice as FlashAttention's ``rowsum(dO * O)``).

The forward (whole-stack buffers, what the Triton path runs) keeps the
sources in one ``[n + 1, ..., D]`` buffer filled in place, their inverse RMS
in an ``[n + 1, ...]`` buffer, and serves ``G`` consecutive sites with one
pass over the sources they all read (DESIGN.md §3, "two-phase"): when site
``j0`` is due, sources ``0 .. j0`` are read once for the queries of sites
``j0 .. j0+G-1``; site ``j0`` is then complete, and site ``j0 + k`` resumes
from its partial softmax over those sources (stored normalised, in the
sources' dtype, with its log-sum-exp) and reads only ``s_{j0+1} .. s_{j0+k}``.
Bytes per group: ``j0 + 1`` source reads instead of ``G (j0 + 1)``, plus one
partial written and read per resumed site (:func:`site_group_size`).
The backward mirrors it: when source ``i0`` is due, the cotangents of sites
``i0 .. n`` are read once for the gradients of sources ``i0 .. i0-G+1``;
source ``i0 - k`` later adds the ``k`` rows its group's sublayers produced
since (partial sums stored in the sources' dtype, per-head statistics in
float32).

Memory: the residuals are the sources, the sites' outputs (which the
sublayers save anyway), ``[.., H]`` statistics per site and each sublayer's
own autodiff residuals: the same as differentiating the loop.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mhar_jax.kernels.reference import _heads, _mix, inv_rms

Apply = Callable[[int, Any, jax.Array, Any], jax.Array]


def routed_stack(h: jax.Array, params: Sequence[Any], apply: Apply,
                 queries: jax.Array, gains: jax.Array, consts: Any = None, *,
                 num_heads: int, eps: float = 1e-6,
                 impl: str | None = None,
                 site_group: int | None = None) -> jax.Array:
  """The output of the last routing site of a fully routed stack.

  Args:
    h: ``[..., D]`` the first source (the token embedding).
    params: ``n`` pytrees, the parameters of each sublayer.
    apply: ``apply(j, params[j], x, consts) -> y``, sublayer ``j`` as a pure
      function ``[..., D] -> [..., D]`` (same dtype as ``h``). Must be hashable
      (a module-level function or a ``functools.partial`` of one).
    queries, gains: ``[n + 1, D]`` pseudo-queries and key-norm gains of the
      sites ``0 .. n``.
    consts: arrays the sublayers read but are not differentiated for (e.g.
      positions); they get zero cotangents.
    num_heads: H, dividing D (1 is AttnRes).
    eps: key RMSNorm epsilon.
    impl: ``"auto"`` / ``None`` (Triton on a CUDA backend with jax-triton,
      else jnp), ``"reference"`` or ``"triton"``, as for
      :func:`mhar_jax.kernels.route`.
    site_group: sites served by one pass over their common sources in the
      forward of the Triton path, and sources per pass over their readers'
      cotangents in its backward (capped by the kernel's registers); 1:
      none; ``None`` picks the byte-minimal size (:func:`site_group_size`).
      Changes rounding only.

  Returns:
    ``x_n`` ``[..., D]`` in ``h``'s dtype.
  """
  from mhar_jax.kernels import resolve_impl
  n = len(params)
  d = h.shape[-1]
  if queries.shape != (n + 1, d) or gains.shape != (n + 1, d):
    raise ValueError(
        f"routed_stack: queries {queries.shape} and gains {gains.shape} must"
        f" both be ({n + 1}, {d}): one per site of {n} sublayers.")
  if num_heads < 1 or d % num_heads:
    raise ValueError(f"routed_stack: num_heads={num_heads} must be >= 1 and"
                     f" divide the width D={d}.")
  if site_group is not None and not 1 <= int(site_group) <= MAX_SITE_GROUP:
    raise ValueError(f"routed_stack: site_group={site_group} must be in"
                     f" 1..{MAX_SITE_GROUP} (or None for automatic).")
  group = site_group_size(n) if site_group is None else int(site_group)
  plan = _Plan(num_heads, float(eps), resolve_impl(impl), group=group)
  if plan.impl == "triton":
    from mhar_jax.kernels import triton_route, triton_stack
    mesh, axes = triton_route.sharding_plan(h)
    plan = dataclasses.replace(
        plan, mesh=mesh, batch_axes=axes,
        bwd_group=min(group, triton_stack.max_grad_group(d, num_heads)))
  return _stack(h, tuple(params), queries, gains, consts, apply, plan)


MAX_SITE_GROUP = 8


def forward_bytes(n: int, group: int) -> int:
  """Source-sized reads and writes of the buffered forward of ``n``
  sublayers (``n + 1`` sites) in groups of ``group`` sites."""
  total, j = 0, 0
  while j <= n:
    gs = min(group, n + 1 - j)
    # one pass over s_0..s_j; writes x_j and gs - 1 partials; then each
    # resumed site reads its partial and k new sources and writes x_{j+k}
    total += (j + 1) + gs + sum(k + 2 for k in range(1, gs))
    j += gs
  return total


def site_group_size(n: int) -> int:
  """The power-of-two group size up to ``MAX_SITE_GROUP`` with the fewest
  forward bytes (:func:`forward_bytes`): 4 at 24 sublayers, 8 at 48 and 72.
  (The kernel pads the group to a power of two, so others waste registers.)"""
  sizes = [1 << k for k in range(MAX_SITE_GROUP.bit_length())
           if 1 << k <= MAX_SITE_GROUP]
  return min(sizes, key=lambda g: (forward_bytes(n, g), g))


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static choices of one ``routed_stack`` call."""
  num_heads: int
  eps: float
  impl: str                 # "reference" | "triton"
  group: int = 1            # sites per pass of the buffered forward
  bwd_group: int | None = None  # sources per backward pass (None: group)
  mesh: Any = None          # triton: shard_map over this mesh's batch axes
  batch_axes: tuple = ()
  # Whole-stack buffers (what the kernels read; always with triton) or
  # Python lists of per-site arrays (the jnp path: no buffer, no copies, the
  # loop's memory).
  buffers: bool = False

  @property
  def use_buffers(self) -> bool:
    return self.impl == "triton" or bool(self.buffers)


def _site(sources, t_j, r, plan):
  """Output ``[..., D]`` (sources' dtype) and log-sum-exp ``[..., H]`` of one
  site on the list path; ``t_j [H, C]`` is query * gain, ``r [S, ...]`` the
  sources' inv-RMS."""
  st = jnp.stack(sources)
  u = jnp.einsum("s...hc,hc->s...h", _heads(st, plan.num_heads), t_j)
  logit = jnp.stack(r)[..., None] * u
  lse = jax.nn.logsumexp(logit, axis=0)
  w = jnp.exp(logit - lse)
  return _mix(st, w, plan.num_heads).astype(st.dtype), lse


def site_group(S, R, t, i0: int, ns: int, resume, num_heads: int):
  """One pass over sources ``S[i0 : i0 + ns]`` for ``G`` sites' queries.

  ``S [R, ..., D]`` the source buffer, ``R [R, ...]`` float32 inverse RMS of
  each row, ``t [G, D]`` float32 query * gain of the sites. ``resume``:
  ``None``, or ``(pout [K, ..., D], plse [K, ..., H], k)``: start (G = 1) from
  row ``k`` of an earlier pass's partial results, which enter the softmax as
  one more source of value ``pout[k]`` and logit ``plse[k]``.

  Returns ``(out [..., D], lse [..., H], pout [G-1, ..., D], plse [G-1, ...,
  H])``: site 0's output (sources' dtype) and log-sum-exp, and the partial
  (normalised) outputs and log-sum-exps of sites ``1 .. G-1`` over these
  sources. The jnp reference of :func:`mhar_jax.kernels.triton_stack.site_group`.
  """
  g = t.shape[0]
  st = jax.lax.slice_in_dim(S, i0, i0 + ns)
  r = jax.lax.slice_in_dim(R, i0, i0 + ns).astype(jnp.float32)
  u = jnp.einsum("s...hc,ghc->gs...h", _heads(st, num_heads),
                 t.reshape(g, num_heads, -1))
  logit = r[None, ..., None] * u                    # [G, S, ..., H]
  vals = st
  if resume is not None:
    pout, plse, k = resume
    logit = jnp.concatenate([jnp.broadcast_to(plse[k], logit[:, :1].shape),
                             logit], axis=1)
    vals = jnp.concatenate([pout[k][None], st])
  lse = jax.nn.logsumexp(logit, axis=1)             # [G, ..., H]
  w = jnp.exp(logit - lse[:, None])
  out = jnp.stack([_mix(vals, w[q], num_heads) for q in range(g)]).astype(
      S.dtype)
  return out[0], lse[0], out[1:], lse[1:]


def _source_group_grad(S, R, dX, t, lse, xd, si, g, j0, m, resume, plan):
  if plan.impl == "triton":
    from mhar_jax.kernels import triton_stack
    return triton_stack.source_group_grad(S, R, dX, t, lse, xd, si, g, j0, m,
                                          resume, plan.num_heads, plan.mesh,
                                          plan.batch_axes)
  return source_group_grad(S, R, dX, t, lse, xd, si, g, j0, m, resume,
                           plan.num_heads)


def _site_group(S, R, t, i0, ns, resume, plan):
  if plan.impl == "triton":
    from mhar_jax.kernels import triton_stack
    return triton_stack.site_group(S, R, t, i0, ns, resume, plan.num_heads,
                                   plan.mesh, plan.batch_axes)
  return site_group(S, R, t, i0, ns, resume, plan.num_heads)


def _forward_buffers(h, params, t, consts, apply, plan, save):
  """The forward on whole-stack buffers, ``plan.group`` sites per pass."""
  n = len(params)
  tt = t.reshape(n + 1, -1)
  S = jnp.zeros((n + 1, *h.shape), h.dtype).at[0].set(h)
  R = jnp.zeros((n + 1, *h.shape[:-1]), jnp.float32).at[0].set(
      inv_rms(h, plan.eps))
  xs, lses, vjps = [], [], []
  j0 = partial = None
  for j in range(n + 1):
    if j0 is None or j - j0 >= plan.group:
      j0, gs = j, min(plan.group, n + 1 - j)
      x, lse, pout, plse = _site_group(S, R, tt[j:j + gs], 0, j + 1, None,
                                       plan)
      partial = (pout, plse)
    else:
      x, lse, _, _ = _site_group(S, R, tt[j:j + 1], j0 + 1, j - j0,
                                 (*partial, j - j0 - 1), plan)
    xs.append(x)
    lses.append(lse)
    if j == n:
      break
    y, vjp = _apply(apply, j, params[j], x, consts, h, save)
    vjps.append(vjp)
    S = S.at[j + 1].set(y)
    R = R.at[j + 1].set(inv_rms(y, plan.eps))
  return xs[-1], (S, R, xs, lses, vjps, t)


def _apply(apply, j, p, x, consts, h, save):
  """Sublayer ``j`` at ``x``: ``(y, vjp or None)``, checked against ``h``."""
  if save:
    y, vjp = jax.vjp(lambda p, x: apply(j, p, x, consts), p, x)
  else:
    y, vjp = apply(j, p, x, consts), None
  if y.shape != h.shape or y.dtype != h.dtype:
    raise ValueError(
        f"routed_stack: sublayer {j} returned {y.shape} {y.dtype}; it must"
        f" return the sources' shape and dtype, {h.shape} {h.dtype}.")
  return y, vjp


def _forward(h, params, queries, gains, consts, apply, plan, save):
  t = (queries.astype(jnp.float32) * gains.astype(jnp.float32)).reshape(
      queries.shape[0], plan.num_heads, -1)
  if plan.use_buffers:
    return _forward_buffers(h, params, t, consts, apply, plan, save)
  sources, rs, xs, lses, vjps = [h], [inv_rms(h, plan.eps)], [], [], []
  for j, p in enumerate(params):
    x, lse = _site(sources, t[j], rs, plan)
    y, vjp = _apply(apply, j, p, x, consts, h, save)
    vjps.append(vjp)
    xs.append(x)
    lses.append(lse)
    sources.append(y)
    rs.append(inv_rms(y, plan.eps))
  x, lse = _site(sources, t[-1], rs, plan)
  xs.append(x)
  lses.append(lse)
  return x, (sources, rs, xs, lses, vjps, t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _stack(h, params, queries, gains, consts, apply, plan):
  return _forward(h, params, queries, gains, consts, apply, plan,
                  save=False)[0]


def _stack_fwd(h, params, queries, gains, consts, apply, plan):
  x, saved = _forward(h, params, queries, gains, consts, apply, plan,
                      save=True)
  return x, (saved, queries, gains, consts)


def source_group_grad(S, R, dX, t, lse, xd, si: int, g: int, j0: int,
                      m: int, resume, num_heads: int):
  """One pass over site rows ``j0 .. j0+m-1`` for the gradients of ``g``
  sources, rows ``si, si-1, .., si-g+1`` of ``S``.

  Whole-stack buffers: ``S [R, ..., D]`` (sources), ``R [R, ...]`` (their
  inverse RMS), ``dX [R, ..., D]`` (site cotangents), ``t [R, D]`` (query *
  gain), ``lse``/``xd [R, ..., H]`` (the sites' log-sum-exp and ``<dx_j,
  x_j>`` per head). ``resume``: ``None``, or ``(pacc [K,
  ..., D], pcoef [K, ..., H], k)``: add row ``k`` of an earlier pass's
  partial sums (g = 1). Returns ``(ds [..., D], pacc [g-1, ..., D], pcoef
  [g-1, ..., H], dt [g, m, D])``: source ``si``'s gradient (complete when
  these are all the rows that read it), the other sources' partial sums
  ``sum_j w dx_j + (dlogit r) t_j`` (sources' dtype) and ``sum_j dlogit *
  logit`` (per head), and each source's share of rows ``j0 ..``'s
  query-gain gradient. The jnp reference of
  :func:`mhar_jax.kernels.triton_stack.source_group_grad`.
  """
  d = S.shape[-1]
  dx = _heads(jax.lax.slice_in_dim(dX, j0, j0 + m), num_heads)
  tm = jax.lax.slice_in_dim(t, j0, j0 + m).reshape(m, num_heads, -1)
  tb = tm.reshape(m, *([1] * (S.ndim - 2)), *tm.shape[1:])
  lse_m = jax.lax.slice_in_dim(lse, j0, j0 + m)
  xd_m = jax.lax.slice_in_dim(xd, j0, j0 + m)
  accs, coefs, dts = [], [], []
  for q in range(g):
    sh = _heads(S[si - q], num_heads)                # [..., H, C]
    r = R[si - q].astype(jnp.float32)[None, ..., None]
    logit = r * jnp.sum(sh[None] * tb, axis=-1)      # [m, ..., H]
    w = jnp.exp(logit - lse_m)
    dlogit = w * (jnp.sum(dx * sh[None], axis=-1) - xd_m)
    dlr = dlogit * r
    acc = jnp.sum(w[..., None] * dx + dlr[..., None] * tb, axis=0)
    coef = jnp.sum(dlogit * logit, axis=0)           # [..., H]
    if resume is not None:
      acc = acc + _heads(resume[0][resume[2]], num_heads).astype(jnp.float32)
      coef = coef + resume[1][resume[2]]
    accs.append(acc)
    coefs.append(coef)
    dts.append(jnp.einsum("m...h,...hc->mhc", dlr, sh).reshape(m, d))
  s0 = S[si]
  r0 = R[si].astype(jnp.float32)
  ds = (accs[0] - (jnp.sum(coefs[0], axis=-1) * r0 ** 2 / d)[..., None, None]
        * _heads(s0, num_heads).astype(jnp.float32))
  lead = S.shape[1:-1]
  pacc = jnp.stack([a.reshape(*lead, d) for a in accs[1:]]).astype(
      S.dtype) if g > 1 else jnp.zeros((0, *lead, d), S.dtype)
  pcoef = jnp.stack(coefs[1:]) if g > 1 else jnp.zeros(
      (0, *lead, num_heads), jnp.float32)
  return ds.reshape(s0.shape).astype(S.dtype), pacc, pcoef, jnp.stack(dts)


def _source_grad_lists(s, r, dxs, xs_dot, t, lses, num_heads):
  """:func:`source_group_grad` for one source on per-site arrays (the list
  path): ``s [..., D]``, ``r [...]``, ``dxs[k] [..., D]``,
  ``xs_dot[k]``/``lses[k] [..., H]``, ``t [m, D]``. Returns ``(ds [..., D],
  dt [m, D])``."""
  d = s.shape[-1]
  sh = _heads(s, num_heads)
  r = r.astype(jnp.float32)[..., None]
  ds = jnp.zeros_like(sh)
  coef = jnp.zeros(sh.shape[:-1], jnp.float32)     # sum_k dlogit * logit
  dts = []
  for dx, xd, tk, lse in zip(dxs, xs_dot, t.reshape(len(dxs), num_heads, -1),
                             lses):
    dx = _heads(dx, num_heads)
    u = jnp.einsum("...hc,hc->...h", sh, tk)
    logit = r * u
    w = jnp.exp(logit - lse)
    dlogit = w * (jnp.einsum("...hc,...hc->...h", dx, sh) - xd)
    ds = ds + w[..., None] * dx + (dlogit * r)[..., None] * tk
    coef = coef + dlogit * logit
    dts.append(jnp.einsum("...h,...hc->hc", dlogit * r, sh))
  ds = ds - (jnp.sum(coef, axis=-1) * r[..., 0] ** 2 / d)[..., None, None] * sh
  return ds.reshape(s.shape).astype(s.dtype), jnp.stack(dts).reshape(-1, d)


def _stack_bwd(apply, plan, res, g):
  (sources, rs, xs, lses, vjps, t), queries, gains, consts = res
  # buffers: sources [n+1, ..., D] and rs [n+1, ...]; else lists
  n, h = len(vjps), plan.num_heads
  tt = t.reshape(n + 1, -1)
  dt = jnp.zeros_like(tt)
  dparams = [None] * n

  def dot_heads(a, b):
    return jnp.einsum("...hc,...hc->...h", _heads(a, h), _heads(b, h))

  if plan.use_buffers:
    # Whole-stack buffers, filled from the top as the sites' cotangents
    # appear; each is updated in place (its only reader, the per-source
    # call, runs before the update that depends on its result).
    dX = jnp.zeros((n + 1, *g.shape), sources.dtype).at[n].set(
        g.astype(sources.dtype))
    xd = jnp.zeros((n + 1, *g.shape[:-1], h), jnp.float32).at[n].set(
        dot_heads(g, xs[n]))
    lse = jnp.stack(lses)
  else:
    dxs, xds = [None] * (n + 1), [None] * (n + 1)
    dxs[n], xds[n] = g, dot_heads(g, xs[n])
  dh = None
  i0 = partial = None
  bwd_group = plan.group if plan.bwd_group is None else plan.bwd_group
  for i in range(n, -1, -1):            # source i is read by sites i .. n
    if plan.use_buffers and (i0 is None or i0 - i >= bwd_group):
      # sources i .. i-gs+1 in one pass over the rows i .. n
      i0, gs = i, min(bwd_group, i + 1)
      ds, pacc, pcoef, dti = _source_group_grad(
          sources, rs, dX, tt, lse, xd, i, gs, i, n + 1 - i, None, plan)
      partial = (pacc, pcoef)
      for q in range(gs):
        dt = dt.at[i0:].add(dti[q])
    elif plan.use_buffers:
      # the rows i .. i0-1 that appeared since the group's pass
      ds, _, _, dti = _source_group_grad(
          sources, rs, dX, tt, lse, xd, i, 1, i, i0 - i,
          (*partial, i0 - i - 1), plan)
      dt = dt.at[i:i0].add(dti[0])
    else:
      ds, dti = _source_grad_lists(sources[i], rs[i], dxs[i:], xds[i:],
                                   tt[i:], lses[i:], h)
      dt = dt.at[i:].add(dti)
    if i == 0:
      dh = ds
      break
    dparams[i - 1], dx = vjps[i - 1](ds)
    if plan.use_buffers:
      dX = dX.at[i - 1].set(dx.astype(dX.dtype))
      xd = xd.at[i - 1].set(dot_heads(dx, xs[i - 1]))
    else:
      dxs[i - 1], xds[i - 1] = dx, dot_heads(dx, xs[i - 1])
  # Site 0 reads s_0 alone: its query and gain have exactly zero gradient.
  # The formula leaves rounding noise there (<dx_0, s_0> - xd_0), which
  # Adam would turn into a random walk of parameters that cannot matter.
  dt = dt.at[0].set(0.0).reshape(queries.shape)
  dqueries = (dt * gains.astype(jnp.float32)).astype(queries.dtype)
  dgains = (dt * queries.astype(jnp.float32)).astype(gains.dtype)
  dconsts = jax.tree.map(_zero_cotangent, consts)
  return dh, tuple(dparams), dqueries, dgains, dconsts


def _zero_cotangent(x):
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, dtype=jax.dtypes.float0)


_stack.defvjp(_stack_fwd, _stack_bwd)
