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

**Blocks** (Block AttnRes / Block MHAR, ``blocks=``): sublayers are grouped into
blocks of consecutive sublayers; a site reads ``[s_0, finished block sums...,
the current block's partial sum]`` (DESIGN.md §1). The same backward then works
source by source over those arrays: a finished block sum is read by every site
after its block (one contiguous run of sites to the end), a partial sum by its
one site, and the gradient of a sublayer's output is the finished sum's
gradient plus those of the partial sums after it in its block (a running sum
kept while the backward walks the block down). One sublayer per block is the
full method.

Memory: the residuals are the sources, the sites' outputs (which the
sublayers save anyway), ``[.., H]`` statistics per site and each sublayer's
own autodiff residuals: the same as differentiating the loop. The sites'
cotangents, which the backward keeps from the top down, go into the buffer
of the saved sources when there is one (full method with site groups), each
into the row of the source the backward has just finished with, so the
backward adds no whole-stack buffer of its own. (Blocks keep their partial
sums as a list and each block's sites' cotangents in a buffer of their own,
made when the first appears, so that they grow as the sublayers' residuals
die; a block sum read by the sites of several blocks sums its share of each
buffer in turn.) With ``project``, the sources are not kept: each sublayer's
output is recomputed from the input of its output projection, which that
projection's gradient keeps anyway, when the backward reaches it (blocks:
the block's partial sums and block sum are added up again from its
recomputed outputs when the backward enters the block); with site groups
the full method's cotangents then go into one buffer per group of sites, as
the blocks' do (a group's share of the sites above it is summed over those
buffers in turn).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jex_core
import jax.numpy as jnp
import numpy as np

from mhar_jax.kernels.reference import _heads, inv_rms, rms_norm

Apply = Callable[[int, Any, jax.Array, Any], jax.Array]
Project = Callable[[int, Any, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class SublayerRMSNorm:
  """Sublayer ``j``'s input norm, an RMSNorm over the last axis::

      y = x * rsqrt(mean(x^2) + eps) * scale(j, params[j])

  in float32, the input's dtype out (:func:`reference.rms_norm`, as
  ``layers.RMSNorm``). ``scale(j, p) -> [D]`` reads the gain from the
  sublayer's parameters; hashable like ``apply`` (a module-level function
  or a ``functools.partial`` of one). Knowing the norm, the Triton
  backward takes its gradient in one kernel (``triton_stack.norm_grad``),
  writing ``dx`` straight into the cotangent buffer; the jnp path takes it
  by autodiff of this call.
  """
  scale: Callable[[int, Any], jax.Array]
  eps: float = 1e-6

  def __call__(self, j: int, p: Any, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.scale(j, p), self.eps)


# routed_stack's site_group where groups route on tensor cores. 1b training on
# the H200: 0.833 of the baseline's tokens/s with groups of 16 (RESULTS.md
# session 13) against 0.742 site by site (session 11), peak memory 1.086x
# against 1.063x.
AUTO_SITE_GROUP = 16


def routed_stack(h: jax.Array, params: Sequence[Any], apply: Apply,
                 queries: jax.Array, gains: jax.Array, consts: Any = None, *,
                 num_heads: int, eps: float = 1e-6,
                 impl: str | None = None,
                 blocks: Sequence[int] | None = None,
                 site_group: int | None = None,
                 project: Project | None = None,
                 norm: SublayerRMSNorm | None = None,
                 recompute_below: int | None = None) -> jax.Array:
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
    blocks: ``n`` block indices, one per sublayer, non-decreasing from 0 in
      steps of 0 or 1 (e.g. ``layers.router.block_boundaries``): Block
      AttnRes / MHAR. ``None`` (or one block per sublayer) is the full method.
    site_group: route consecutive sites in groups, two-phase (DESIGN.md §3):
      one pass over the sources that exist when a group's first site is
      reached serves every site of the group, and each later site of the
      group then routes only the sources produced since, continuing that
      result. ``0`` or ``1``: every site on its own. ``G >= 2``: the full
      method in groups of G sites (the first of G - 1, so that every later
      group's first site reads a multiple of G sources); blocked routing in
      groups of one block's sites (they share the finished block sums). The
      same function as site by site, up to rounding: the first phase's
      output is stored in the sources' dtype. With Triton, a group of at least
      ``triton_stack.SITES_TUNING["min_sites"]`` sites does its first phase
      on tensor cores (``triton_stack.sites``) over a buffer of the finished
      sources, which the backward then reads instead of the list, taking
      the sources in groups of G too (``triton_stack.sources_partial``);
      every group does when that buffer is saved (sources not recomputed).
      Full method only (blocked groups on tensor cores were slower).
      ``None``: :data:`AUTO_SITE_GROUP` where those groups route on tensor
      cores (Triton, the full method, a head width they take), else 0.
    project: ``project(j, params[j], u) -> y``, hashable like ``apply``:
      sublayer ``j``'s output projection. Given, ``apply`` returns its input
      ``u`` (e.g. the attention heads before W_o) and the sublayer is
      ``project(j, p, apply(j, p, x, consts))``. The backward then
      recomputes each sublayer's output from ``u`` (kept anyway for the
      projection's gradient) instead of keeping the sources (full method)
      or the block and partial sums (blocks: added up again per block): one
      copy of the sources less in memory for one more projection a
      sublayer. An identity ``project`` (``u`` is the output) keeps that
      sublayer's output.
    norm: a :class:`SublayerRMSNorm`, sublayer ``j``'s first step (its
      input norm), whose input is the site's output ``x_j``. Given,
      ``apply`` takes the norm's output ``y`` (the sublayer is
      ``apply(j, p, norm(j, p, x), consts)``), the backward takes the
      norm's gradient itself (on Triton with ``triton_stack.NORM_TUNING
      ["kernel"]``, one kernel a site writing ``dx`` into the cotangent
      buffer in place, and with ``["dy_terms"]`` above 1 reading ``dy`` as
      the matrix products' terms autodiff would add, ``_cotangent_terms``;
      else by autodiff), and the stack keeps no output of
      the sites below ``recompute_below``: the backward recomputes ``x_j``
      from the kept sources when it reaches sublayer ``j`` (full method:
      one pass a group of sites over the sources they read, site ``k``
      reading ``s_0 .. s_k`` (``triton_stack.sites(causal=True)`` on
      tensor cores); blocks: each site over its block sums and partial
      sum), then takes the norm's gradient. The norm's input is what the
      baseline keeps for its norms: one ``[..., D]`` array a sublayer less
      in memory for one more routing pass. Not with ``project`` (it needs
      the sources kept).
    recompute_below: with ``norm``, only the sites ``0 .. recompute_below -
      1`` have their outputs recomputed; the sites above keep theirs (their
      norms' gradients taken from the kept input). ``None``: every site.
      The lowest sites read the fewest sources (the full method's site k
      reads k + 1), so they free the same memory a site for the least
      recomputation.

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
  blocks = tuple(range(n)) if blocks is None else tuple(int(b) for b in blocks)
  if (len(blocks) != n or (n and blocks[0] != 0)
      or any(b - a not in (0, 1) for a, b in zip(blocks, blocks[1:]))):
    raise ValueError(
        f"routed_stack: blocks={blocks} must give one block index per"
        f" sublayer ({n}), starting at 0 and growing by 0 or 1.")
  if site_group is not None and int(site_group) < 0:
    raise ValueError(f"routed_stack: site_group={site_group} must be >= 0"
                     " (or None: automatic).")
  if norm is not None and project is not None:
    raise ValueError("routed_stack: norm (recompute the sites' outputs) needs"
                     " the sources kept; it cannot be combined with project"
                     " (recompute the sources). Pass one of them.")
  if norm is not None and not isinstance(norm, SublayerRMSNorm):
    raise ValueError(f"routed_stack: norm={norm!r} must be a SublayerRMSNorm"
                     " (the sublayers' input RMSNorm: its gain and epsilon).")
  if recompute_below is not None and (norm is None or not
                                      0 <= int(recompute_below) <= n):
    raise ValueError(f"routed_stack: recompute_below={recompute_below} needs"
                     f" norm and must lie in [0, {n}] (the sites 0 .. {n - 1}"
                     " have norms).")
  plan = _Plan(num_heads, float(eps), resolve_impl(impl), blocks=blocks,
               recompute_below=None if recompute_below is None
               else int(recompute_below))
  if site_group is None:
    site_group = (AUTO_SITE_GROUP
                  if _tensor_core_group(plan, AUTO_SITE_GROUP, d) else 0)
  plan = dataclasses.replace(plan, site_group=int(site_group))
  if plan.impl == "triton":
    from mhar_jax.kernels import triton_route
    mesh, axes = triton_route.sharding_plan(h)
    plan = dataclasses.replace(plan, mesh=mesh, batch_axes=axes)
  return _stack(h, tuple(params), queries, gains, consts,
                (apply, project, norm), plan)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static choices of one ``routed_stack`` call."""
  num_heads: int
  eps: float
  impl: str                 # "reference" | "triton"
  blocks: tuple = ()        # block index of each sublayer; () = one each
  site_group: int = 0       # see routed_stack
  mesh: Any = None          # triton: shard_map over this mesh's batch axes
  batch_axes: tuple = ()
  recompute_below: int | None = None   # see routed_stack
  # Backward bookkeeping: whole-stack buffers (what the kernel reads) or
  # Python lists of per-site arrays (the jnp path: no buffer, no copies, the
  # loop's memory). The default follows impl.
  buffers: bool | None = None

  @property
  def use_buffers(self) -> bool:
    return self.impl == "triton" if self.buffers is None else self.buffers

  def block_ends(self, n: int) -> list[bool]:
    """:func:`block_ends` of ``blocks`` (one block per sublayer if empty)."""
    return block_ends(self.blocks or range(n))

  def recomputed_sites(self, n: int) -> int:
    """With ``norm``: the sites ``0 .. k - 1`` of ``n`` sublayers recompute
    their outputs in the backward; returns k."""
    return n if self.recompute_below is None else self.recompute_below

  @property
  def full(self) -> bool:
    """Whether this is the full method (one block per sublayer)."""
    return all(block_ends(self.blocks))

  def site_groups(self, n: int) -> list[tuple[int, int]]:
    """The sites ``0 .. n`` as ``[start, stop)`` runs routed together."""
    if self.site_group < 2:
      return [(j, j + 1) for j in range(n + 1)]
    if self.full:   # full method: G - 1 sites, then runs of G from site G - 1
      g = self.site_group     # (site a reads a + 1 sources: a multiple of G)
      starts = [0, *range(g - 1, n + 1, g)]
      return list(zip(starts, [*starts[1:], n + 1]))
    ends = self.block_ends(n)
    starts = [0] + [j + 1 for j in range(n) if ends[j]]   # block starts
    return list(zip(starts, starts[1:] + [n + 1]))


def block_ends(blocks: Sequence[int]) -> list[bool]:
  """Whether sublayer ``j`` is the last of its block, given each sublayer's
  block index ``blocks[j]`` (the last sublayer always is)."""
  return [j + 1 == len(blocks) or blocks[j + 1] != b
          for j, b in enumerate(blocks)]


def _cfg(sources, plan):
  from mhar_jax.kernels import triton_route
  return triton_route._make_cfg(sources[0].shape[-1], plan.num_heads,
                                plan.eps, True, plan.mesh, plan.batch_axes)


def _sites(sources, t, r, plan):
  """G sites reading the same ``sources``: outputs ``[G, ..., D]`` (sources'
  dtype) and log-sum-exps ``[G, ..., H]``; ``t [G, H, C]`` is each site's
  query * gain, ``r`` the sources' inv-RMS."""
  if plan.impl == "triton":
    from mhar_jax.kernels import triton_route
    return triton_route._fwd_impl(tuple(sources), t.reshape(t.shape[0], -1),
                                  _cfg(sources, plan), rs=tuple(r))
  return _sites_jnp(jnp.stack(sources), t, jnp.stack(r), plan.num_heads)


def _sites_jnp(rows, t, r, num_heads: int, causal: bool = False):
  """G sites over the sources ``rows [S, ..., D]`` (``r [S, ...]`` their
  inv-RMS, ``t [G, H, C]`` query * gain) in jnp: outputs ``[G, ..., D]``
  (the rows' dtype) and log-sum-exps ``[G, ..., H]``. ``causal``: site g
  reads only rows ``0 .. S - G + g`` (G consecutive sites of the full
  method, the last reading all S), as ``triton_stack.sites(causal=True)``."""
  st = _heads(rows, num_heads)                            # [S, ..., H, C]
  logit = r[..., None] * jnp.einsum("s...hc,ghc->gs...h", st, t)
  if causal:
    s, g = rows.shape[0], t.shape[0]
    reads = np.arange(s)[None, :] <= np.arange(s - g, s)[:, None]   # [G, S]
    logit = jnp.where(reads.reshape(g, s, *[1] * (logit.ndim - 2)), logit,
                      -jnp.inf)
  lse = jax.nn.logsumexp(logit, axis=1)
  w = jnp.exp(logit - lse[:, None])
  out = jnp.einsum("gs...h,s...hc->g...hc", w, st)
  return out.reshape(*out.shape[:-2], -1).astype(rows.dtype), lse


def _tensor_core_group(plan, g: int, d: int, any_size: bool = False) -> bool:
  """Whether a group of ``g`` sites routes its first phase on tensor cores
  (``triton_stack.sites``), and a group of ``g`` sources its backward share
  (``triton_stack.sources_partial``): Triton, the full method (a block's
  group on tensor cores was slower, RESULTS.md session 12: a block's 9 sites
  over at most 9 sources, padded to 16), at least 2 and
  ``SITES_TUNING["min_sites"]`` rows (``any_size``: any), and a width the
  kernels take."""
  if plan.impl != "triton" or not plan.full:
    return False
  from mhar_jax.kernels import triton_stack
  least = 1 if any_size else max(2, triton_stack.SITES_TUNING["min_sites"])
  return g >= least and triton_stack.sites_supported(d, plan.num_heads, g)


def _continue(outs, lses, k, sources, t_j, r, plan):
  """Site output and log-sum-exp over earlier sources, whose result is row
  ``k`` of ``outs [R, ..., D]`` / ``lses [R, ..., H]``, followed by
  ``sources`` (``t_j [H, C]``, ``r`` their inv-RMS)."""
  if plan.impl == "triton":
    from mhar_jax.kernels import triton_route
    out, lse = triton_route._fwd_impl(tuple(sources), t_j.reshape(1, -1),
                                      _cfg(sources, plan), init=(outs, lses, k),
                                      rs=tuple(r))
    return out[0], lse[0]
  h = plan.num_heads
  st = _heads(jnp.stack(sources), h)
  logit = jnp.stack(r)[..., None] * jnp.einsum("s...hc,hc->s...h", st, t_j)
  lse = jnp.logaddexp(lses[k], jax.nn.logsumexp(logit, axis=0))
  out = (jnp.exp(lses[k] - lse)[..., None] * _heads(outs[k], h)
         + jnp.einsum("s...h,s...hc->...hc", jnp.exp(logit - lse), st))
  return out.reshape(outs.shape[1:]).astype(outs.dtype), lse


def _forward(h, params, queries, gains, consts, fns, plan, save):
  """Runs the stack (``fns = (apply, project, norm)``). Saved: ``done``/
  ``done_r`` (``s_0`` and the finished block sums with their inv-RMS;
  ``done`` as the ``[len(done), ..., D]`` buffer when groups of sites route
  on tensor cores, ``[s_0]`` alone when the sources are recomputed),
  ``partials``/``partial_r`` (per site: the partial sum it reads, or None;
  sites 0 .. n-1, the final site reads none; recomputing, no partial sums
  but their inv-RMS), the sites' outputs (with ``norm``: None for the sites
  that recompute theirs, ``plan.recomputed_sites``) and log-sum-exps, the
  sublayers' VJPs (of ``apply`` alone when recomputing the sources or with
  ``norm``), ``t = query * gain`` and the projections' inputs ``us`` (None
  unless recomputing)."""
  apply, project, norm = fns
  recompute = project is not None
  t = (queries.astype(jnp.float32) * gains.astype(jnp.float32)).reshape(
      queries.shape[0], plan.num_heads, -1)
  ends = plan.block_ends(len(params))
  below = plan.recomputed_sites(len(params))
  group_end = dict(plan.site_groups(len(params)))
  done, done_r = [h], [inv_rms(h, plan.eps)]
  partials, partial_r = [None] * len(params), [None] * len(params)
  xs, lses, vjps, us = [], [], [], []
  partial = None
  # (first site, len(done) then, outputs, log-sum-exps, row of the first's)
  group = None
  # Groups routed on tensor cores read the finished sources from one buffer
  # (rows in ``done``'s order), filled in place as they appear; it is what
  # the backward gets (the list's arrays then die as the forward moves on).
  # Saved, the buffer has one spare row (the backward writes the sites'
  # cotangents into it, one row above the source each replaces). Built for
  # the backward alone with explicit buffers and groups (the jnp path's test
  # of that bookkeeping).
  on_tc = {a for a, b in group_end.items()
           if _tensor_core_group(plan, b - a, h.shape[-1])}
  keep = save and not recompute and plan.full and (
      bool(on_tc) or (plan.use_buffers and plan.site_group >= 2))
  if keep:
    # Saved, the buffer holds every finished source: groups too small to
    # gain from the tensor-core kernel read their rows there too, for any
    # group reading the list would keep each source's own array alive until
    # it runs (350m: the last group, sites 47-48, held 2.9 GiB of them at
    # the forward's end, the step's peak).
    on_tc = {a for a, b in group_end.items()
             if _tensor_core_group(plan, b - a, h.shape[-1], any_size=True)}
  # Not saved, it has the rows the last group on tensor cores reads (its
  # first site a reads the a + 1 sources s_0 .. s_a) and dies there.
  buf = None
  if on_tc or keep:
    rows = sum(ends) + 1 + keep if keep else max(on_tc) + 1
    buf = _rows_buffer(plan, rows, h, h.dtype, -1).at[0].set(h)

  def route_site(j):
    """Site j's output and log-sum-exp (two-phase within its group)."""
    nonlocal group, buf
    live, live_r = list(done), list(done_r)
    if partial is not None:
      live, live_r = live + [partial], live_r + [partial_r[j]]
    if j in group_end:
      row = 0
      if j in on_tc and partial is None:      # live is done: buf's rows
        from mhar_jax.kernels import triton_stack
        # Kept, the buffer has a row for each site's source to come (site
        # k's first-phase result in row k + 1, until source k + 1 replaces
        # it there): no [G, ..., D] result held until the group's last site
        # (100m at 131k tokens: 1.25 GiB at the forward's end, the peak).
        into = keep and group_end[j] < buf.shape[0]
        first = triton_stack.sites(
            buf, jnp.stack(live_r), len(live),
            t[j:group_end[j]].reshape(group_end[j] - j, -1),
            plan.num_heads, plan.mesh, plan.batch_axes,
            out_row=j + 1 if into else None)
        if into:
          buf, row = first[0], j + 1
      else:
        first = _sites(live, t[j:group_end[j]], live_r, plan)
      if group_end[j] == j + 1 and not row:
        group = None
        return first[0][0], first[1][0]
      group = (j, len(live), *first, row)
    a, n_old, outs, glse, row = group
    k = j - a + row
    if row:        # the buffer as the sources written since have left it
      outs = buf
    if len(live) == n_old:           # the group's first site: phase 1 is all
      # Its own arrays: a slice that XLA fuses into each reader (including
      # the backward's) would keep the whole [G, ..., D] result alive (or
      # read the buffer's row after a source replaced it: a copy).
      return jax.lax.optimization_barrier((outs[k], glse[k]))
    return _continue(outs, glse, k, live[n_old:], t[j], live_r[n_old:],
                     plan)

  for j, p in enumerate(params):
    if partial is not None:
      partials[j], partial_r[j] = partial, inv_rms(partial, plan.eps)
    x, lse = route_site(j)
    f = functools.partial(_sublayer, apply, None if recompute else project, j,
                          consts)
    x_in = x if norm is None else norm(j, p, x)
    if save:
      y, vjp = jax.vjp(f, p, x_in)
      vjps.append(vjp)
    else:
      y = f(p, x_in)
    if recompute:
      us.append(y)
      y = project(j, p, y)
    if y.shape != h.shape or y.dtype != h.dtype:
      raise ValueError(
          f"routed_stack: sublayer {j} returned {y.shape} {y.dtype}; it must"
          f" return the sources' shape and dtype, {h.shape} {h.dtype}.")
    xs.append(x if norm is None or j >= below else None)
    lses.append(lse)
    partial = y if partial is None else partial + y
    if ends[j]:
      done.append(partial)
      done_r.append(inv_rms(partial, plan.eps))
      if buf is not None and len(done) <= buf.shape[0]:
        buf = buf.at[len(done) - 1].set(partial)
      partial = None
  x, lse = route_site(len(params))
  xs.append(x)
  lses.append(lse)
  # Save the finished sources once: as the buffer when kept (its rows are
  # ``done``'s, indexed alike by the backward), else as the list; or only
  # s_0, the rest being recomputed from ``us``.
  if recompute:
    return x, ([h], done_r, [None] * len(params), partial_r, xs, lses, vjps,
               t, us)
  return x, (buf if keep else done, done_r, partials, partial_r, xs, lses,
             vjps, t, None)


def _rows_buffer(plan, rows: int, like, dtype, tag: int):
  """``[rows, *like.shape]`` in ``dtype`` for rows each written before it is
  read: unfilled with Triton (``triton_stack.rows_buffer``, made after
  ``like``; ``tag`` distinct for each buffer of the step), else zeros."""
  if plan.impl == "triton":
    from mhar_jax.kernels import triton_stack
    return triton_stack.rows_buffer(rows, like, tag, plan.mesh,
                                    plan.batch_axes, dtype)
  return jnp.zeros((rows, *like.shape), dtype)


def _cotangent_terms(vjp, ct, most: int):
  """``vjp(ct)`` (a VJP whose last output leaf is an input's cotangent) with
  that cotangent as up to ``most`` arrays whose sum it is: ``(outputs, terms)``,
  ``outputs`` as ``vjp`` returns them with ``terms[0]`` as the last leaf.

  Where the input feeds several operations (a sublayer's Q, K and V, or
  SwiGLU's gate and up products), autodiff adds their contributions
  (``add_any``) as its last step; the terms are those additions' operands,
  found in ``vjp``'s jaxpr, so that a kernel can read them and add them
  itself instead of XLA writing their sum. Only sums of matrix products are
  split (XLA fuses an add of elementwise terms into their producer for
  free); anything else is one term."""
  if most <= 1:
    outs = vjp(ct)
    return outs, [jax.tree.leaves(outs)[-1]]
  closed, shapes = jax.make_jaxpr(vjp, return_shape=True)(ct)
  jaxpr = closed.jaxpr
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}

  def split(v):          # the operands of a sum of products at v, else None
    e = producer.get(v) if isinstance(v, jex_core.Var) else None
    if e is None or e.primitive.name != "add_any":
      return None
    if all(split(u) is not None or _is_product(u, producer)
           for u in e.invars):
      return e.invars
    return None

  terms = [jaxpr.outvars[-1]]
  while len(terms) < most:
    for i, v in enumerate(terms):
      parts = split(v)
      if parts is not None:
        terms[i:i + 1] = parts
        break
    else:
      break
  fn = jex_core.jaxpr_as_fun(closed.replace(
      jaxpr=jaxpr.replace(outvars=[*jaxpr.outvars[:-1], *terms])))
  leaves = fn(*jax.tree.leaves(ct))
  n = len(jaxpr.outvars) - 1
  outs = jax.tree.unflatten(jax.tree.structure(shapes), leaves[:n + 1])
  return outs, list(leaves[n:])


_LAYOUT_OPS = ("transpose", "reshape", "convert_element_type", "copy")


def _is_product(var, made) -> bool:
  """Whether ``var`` is a matrix product's result: made (``made``: variable
  -> the equation that makes it) by ``dot_general``, possibly reshaped,
  transposed or converted after, or by a jitted call ending so (as
  ``jnp.einsum``)."""
  e = made.get(var) if isinstance(var, jex_core.Var) else None
  while e is not None and e.primitive.name in _LAYOUT_OPS:
    var = e.invars[0]
    e = made.get(var) if isinstance(var, jex_core.Var) else None
  if e is None:
    return False
  if e.primitive.name == "dot_general":
    return True
  inner = e.params.get("jaxpr")
  if inner is None:
    return False
  inner = getattr(inner, "jaxpr", inner)
  return _is_product(inner.outvars[e.outvars.index(var)],
                     {v: q for q in inner.eqns for v in q.outvars})


def _sublayer(apply, project, j, consts, p, x):
  """Sublayer ``j``: ``apply``, then ``project`` if given."""
  u = apply(j, p, x, consts)
  return u if project is None else project(j, p, u)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _stack(h, params, queries, gains, consts, fns, plan):
  return _forward(h, params, queries, gains, consts, fns, plan,
                  save=False)[0]


def _stack_fwd(h, params, queries, gains, consts, fns, plan):
  x, saved = _forward(h, params, queries, gains, consts, fns, plan,
                      save=True)
  return x, (saved, params, queries, gains, consts)


def source_grad(s, r, dX, t, lse, xd, i: int, num_heads: int,
                m: int | None = None, init=None, dx_row: int | None = None,
                partial: bool = False, s_row: int | None = None,
                init_row: int | None = None):
  """The gradient of a source from the sites ``i .. i+m-1`` that read it.

  ``s [..., D]`` (``s_row``: row ``s_row`` of the buffer ``s``), ``r [...]``;
  whole-stack buffers ``t [R, D]`` (query *
  gain), ``lse``/``xd [R, ..., H]`` (the sites' log-sum-exp and ``<dx_j,
  x_j>`` per head), read from row ``i``, ``m`` rows (default: to the end,
  ``R - i``); ``dX [R', ..., D]`` the sites' cotangents, read from row
  ``dx_row`` (default ``i``). ``init``: None, or the contribution of later
  sites, ``(acc [..., D], coef [..., H])`` from :func:`sources_partial` or
  ``partial`` (``init_row``: that row of each of two buffers), which this
  continues.
  Returns ``(ds [..., D]`` in ``s``'s dtype, ``dt [m, D]`` float32: this
  source's share of those sites' query-gain gradient); ``partial``: ``(acc
  [..., D]`` in ``s``'s dtype, ``coef [..., H]`` float32, ``dt)``, the sums
  for earlier sites to continue. The jnp reference of
  :func:`mhar_jax.kernels.triton_stack.source_grad`. It reads the buffers as
  one slice from row ``i`` (which XLA keeps in place while the backward
  fills earlier rows; reading row by row makes it copy the buffer) and
  reduces over sites with multiply-and-sum, not contractions that would
  materialise a float32 copy of the slice.
  """
  s = s if s_row is None else s[s_row]
  if init is not None and init_row is not None:
    init = tuple(x[init_row] for x in init)
  d = s.shape[-1]
  m = t.shape[0] - i if m is None else m
  x0 = i if dx_row is None else dx_row
  sh = _heads(s, num_heads)                        # [..., H, C]
  r = r.astype(jnp.float32)[None, ..., None]       # [1, ..., 1]
  dx = _heads(dX[x0:x0 + m], num_heads)            # [m, ..., H, C]
  tm = t[i:i + m].reshape(m, num_heads, -1)
  tb = tm.reshape(m, *([1] * (s.ndim - 1)), *tm.shape[1:])
  u = jnp.sum(sh[None] * tb, axis=-1)              # [m, ..., H]
  logit = r * u
  w = jnp.exp(logit - lse[i:i + m])
  dlogit = w * (jnp.sum(dx * sh[None], axis=-1) - xd[i:i + m])
  dlr = dlogit * r
  coef = jnp.sum(dlogit * logit, axis=0)           # [..., H]
  acc = jnp.sum(w[..., None] * dx + dlr[..., None] * tb, axis=0)
  if init is not None:
    acc = acc + _heads(init[0].astype(jnp.float32), num_heads)
    coef = coef + init[1]
  dt = jnp.einsum("m...h,...hc->mhc", dlr, sh).reshape(m, d)
  if partial:
    return acc.reshape(s.shape).astype(s.dtype), coef, dt
  ds = acc - (jnp.sum(coef, -1) * r[0, ..., 0] ** 2 / d)[..., None, None] * sh
  return ds.reshape(s.shape).astype(s.dtype), dt


def sources_partial(S, r, dX, t, lse, xd, j: int, m: int, num_heads: int,
                    init=None, dx_row: int | None = None):
  """The share of the sites ``j .. j+m-1`` in the gradients of G sources.

  ``S [G, ..., D]`` (sources all read by those sites), ``r [G, ...]``; the
  buffers as in :func:`source_grad`: rows ``j .. j+m-1`` of ``t``, ``lse``,
  ``xd``, and of ``dX`` from row ``dx_row`` (default ``j``). ``init``: None,
  or ``(acc, coef)`` returned here for other sites, which this continues.
  Returns ``(acc [G, ..., D]`` in ``S``'s dtype: ``sum_k w dx_k + dlogit r
  t_k``, ``coef [G, ..., H]`` float32: ``sum_k dlogit logit``, ``dt [m, D]``
  float32: the sources' share of those sites' query-gain gradient), which
  :func:`source_grad` (``init=``) completes with the remaining sites. The jnp
  reference of :func:`mhar_jax.kernels.triton_stack.sources_partial`.
  """
  d = S.shape[-1]
  x0 = j if dx_row is None else dx_row
  sh = _heads(S, num_heads).astype(jnp.float32)      # [G, ..., H, C]
  rr = r.astype(jnp.float32)[..., None]              # [G, ..., 1]
  dx = _heads(dX[x0:x0 + m], num_heads).astype(jnp.float32)  # [m, ..., H, C]
  tm = t[j:j + m].reshape(m, num_heads, -1)
  u = jnp.einsum("g...hc,mhc->gm...h", sh, tm)
  logit = rr[:, None] * u                             # [G, m, ..., H]
  w = jnp.exp(logit - lse[None, j:j + m])
  dlogit = w * (jnp.einsum("g...hc,m...hc->gm...h", sh, dx)
                - xd[None, j:j + m])
  dlr = dlogit * rr[:, None]
  acc = (jnp.einsum("gm...h,m...hc->g...hc", w, dx)
         + jnp.einsum("gm...h,mhc->g...hc", dlr, tm))
  coef = jnp.sum(dlogit * logit, axis=1)
  if init is not None:
    acc = acc + _heads(init[0].astype(jnp.float32), num_heads)
    coef = coef + init[1]
  dt = jnp.einsum("gm...h,g...hc->mhc", dlr, sh)
  return (acc.reshape(S.shape).astype(S.dtype), coef,
          dt.reshape(m, d))


def _source_grad_lists(s, r, dxs, xs_dot, t, lses, num_heads):
  """:func:`source_grad` on per-site arrays: ``dxs[k] [..., D]``,
  ``xs_dot[k]``/``lses[k] [..., H]``, ``t [m, D]``; same outputs."""
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


def dot_heads(a: jax.Array, b: jax.Array, num_heads: int) -> jax.Array:
  """``[..., D], [..., D] -> [..., H]``: each head's inner product in float32
  (a site's ``<dx_j, x_j>``)."""
  return jnp.einsum("...hc,...hc->...h", _heads(a, num_heads),
                    _heads(b, num_heads))


def _stack_bwd(fns, plan, res, g):
  (done, done_r, partials, partial_r, xs, lses, vjps, t, us), params, \
      queries, gains, consts = res
  _, project, norm = fns
  n, h = len(vjps), plan.num_heads
  ends = plan.block_ends(n)
  tt = t.reshape(n + 1, -1)
  dt = jnp.zeros_like(tt)
  dparams = [None] * n

  # The backward takes the full method's sources in groups [a, b) from the
  # top when the forward's groups route on tensor cores (or, on the jnp path,
  # with explicit buffers: the test of this bookkeeping): the share of the
  # sites b .. n in their gradients is computed first, for the whole group
  # at once, and each source then adds its sites i .. b-1 on its own.
  grouped = (plan.full and plan.site_group >= 2 and plan.use_buffers and (
      plan.impl == "reference"
      or _tensor_core_group(plan, plan.site_group, g.shape[-1])))
  groups = ([(max(0, b - plan.site_group), b)
             for b in range(n + 1, 0, -plan.site_group)] if grouped else [])
  group_of = {i: (a, b) for a, b in groups if b <= n for i in range(a, b)}
  share = None   # the last group's (a, acc, coef, its sources' rows, first row)

  # The sites' cotangents, filled from the top. With the sources saved as a
  # buffer (rows 0 .. n and a spare one), site k's goes to row k + 1 of that
  # same buffer (``off``): it is written when source k + 1 has its
  # gradient, and nothing reads that source after; one buffer then holds the
  # sources still to come below and the cotangents above. With the sources
  # recomputed and taken in groups, each group's sites have a buffer of
  # their own (``spans``, from the top), made when the first of them has its
  # cotangent: the cotangents grow as the sublayers' residuals die, instead
  # of one whole-stack buffer made at the backward's start; so too each
  # block's sites with blocks. A source read by sites of several spans sums
  # their shares in turn (a group of sources on Triton: up to
  # ``triton_stack.SOURCES_TUNING["max_buffers"]`` spans a launch, from the
  # bottom). Otherwise one buffer.
  shared = not isinstance(done, list)
  off = int(shared)
  if grouped and us is not None:
    spans = groups
  elif not plan.full:
    starts = [0] + [j + 1 for j in range(n) if ends[j]] + [n + 1]
    spans = list(zip(starts[:-1], starts[1:]))[::-1]
  else:
    spans = [(0, n + 1)]
  span_of = {k: ab for ab in spans for k in range(*ab)}
  # Recomputed groups below the top: a group's share (its sources' sums over
  # the sites above, row ``i - a`` for source i) and its sites' cotangents
  # (site k in row ``k - a + 1``) share one buffer: each cotangent is written
  # once the share row below it has been read (source k + 1's gradient).
  merged = grouped and us is not None

  def span_off(a, b):
    """Row of span [a, b)'s first site in its cotangent buffer."""
    return 1 if merged and b <= n else off
  if plan.use_buffers:
    # The buffers are updated in place (their readers, the per-source calls,
    # run before the update that depends on their result). Site k is row
    # k + off of the whole-stack statistics and of ``rows_t`` (``tt`` so
    # indexed), and row k - a + off of its span [a, b)'s cotangents.
    dtype = done[0].dtype
    cots = {0: done} if shared else {}
    xd = jnp.zeros((n + 1 + off, *g.shape[:-1], h), jnp.float32).at[
        n + off].set(dot_heads(g, xs[n], h))
    lse = jnp.stack([jnp.zeros_like(lses[0])] * off + lses)
    rows_t = jnp.pad(tt, ((off, 0), (0, 0)))
  else:
    dxs, xds = [None] * (n + 1), [None] * (n + 1)
    dxs[n], xds[n] = g, dot_heads(g, xs[n], h)

  def row_of(k, like):
    """``(span, row)`` of site ``k``'s cotangent in its span's buffer,
    made if new, after ``like`` (tag: the span)."""
    a, b = span_of[k]
    if a not in cots:
      cots[a] = _rows_buffer(plan, b - a + span_off(a, b), like, dtype, a)
    return a, k - a + span_off(a, b)

  def put(k, dx):
    """Site ``k``'s cotangent into its span's buffer."""
    a, row = row_of(k, dx)
    cots[a] = cots[a].at[row].set(dx.astype(dtype))

  def cotangents(lo, hi):
    """``(buffer, first site, sites, the first's row)`` of each span holding
    some of the sites ``lo .. hi-1``."""
    return [(cots[a], max(a, lo), min(b, hi) - max(a, lo),
             max(a, lo) - a + span_off(a, b))
            for a, b in spans if a < hi and b > lo]

  if plan.use_buffers:
    put(n, g)

  # Recomputing: sublayer j's output and the VJP of its projection, from
  # when the backward first needs it until sublayer j's gradient is taken
  # (the full method's source j + 1; blocks: summed into its block's). Its
  # inputs pass an optimization barrier with the latest cotangent
  # (``after``), so that XLA neither merges the recomputation with the
  # forward's product (which would keep the source alive after all) nor
  # hoists it.
  projected, after = {}, g
  sums = {}        # recomputed block sums (by ``done`` index), partial sums

  def projection(j):
    """Sublayer ``j``'s output recomputed from its projection's input (the
    projection's VJP kept in ``projected[j]`` for sublayer j's gradient)."""
    if j not in projected:
      _, p, u = jax.lax.optimization_barrier((after, params[j], us[j]))
      projected[j] = jax.vjp(functools.partial(project, j), p, u)
    return projected[j][0]

  def recompute_block(e, k):
    """Recomputed, the sums of the block ending at sublayer ``e`` (``done``
    index ``k``): the partial sum each of its sites after the first reads
    (``sums[("site", j)]``) and the block sum (``sums[k]``), added as the
    forward added them."""
    a = e
    while a > 0 and not ends[a - 1]:
      a -= 1
    run = None
    for j in range(a, e + 1):
      if run is not None:
        sums["site", j] = run
      run = projection(j) if run is None else run + projection(j)
    sums[k] = run

  def source(k):
    """Finished source ``k`` (``done``'s index; recomputed: sublayer k-1's
    output, or the block sum that :func:`recompute_block` left) when the
    sources are not the shared buffer's rows (those are read in place, not
    yet overwritten: k <= the next cotangent's row)."""
    if us is None or k == 0:
      return done[k]
    return projection(k - 1) if plan.full else sums[k]

  def grad_of(k, i, m):
    """Gradient of finished source ``k`` read by sites ``i .. i+m-1``."""
    if shared:       # its row of the buffer, read in place (a slice: a copy)
      return _grad_of(cots[0], done_r[k], i, m, s_row=k)
    return _grad_of(source(k), done_r[k], i, m)

  def _grad_of(s, r, i, m, s_row=None):
    """Gradient of source ``s`` (``s_row``: row ``s_row`` of the buffer
    ``s``) read by sites ``i .. i+m-1``; adds its share of those sites'
    query-gain gradient to ``dt``."""
    nonlocal dt, share
    init_row = None
    if plan.impl == "triton":
      from mhar_jax.kernels import triton_stack
    init = None
    if i in group_of:
      a, b = group_of[i]
      if share is None or share[0] != a:
        rows, a0 = ((cots[0], a) if shared else
                    (jnp.stack([source(k) for k in range(a, b)]), 0))
        r_ab = jnp.stack(done_r[a:b])
        part = None
        spans_above = cotangents(b, n + 1)
        if plan.impl == "triton":   # one launch reads consecutive spans'
          spans_above.sort(key=lambda span: span[1])    # buffers, sites up
          runs = triton_stack.mergeable_pieces(
              [k for *_, k, _ in spans_above])
        else:
          runs = [1] * len(spans_above)
        for length in runs:
          run, spans_above = spans_above[:length], spans_above[length:]
          lo, rows_m = run[0][1], sum(k for *_, k, _ in run)
          if plan.impl == "triton":
            part = triton_stack.sources_partial(
                rows, a0, b - a, r_ab,
                [(buf, row, k) for buf, _, k, row in run], rows_t, lse, xd,
                lo + off, rows_m, h, plan.mesh, plan.batch_axes, init=part,
                into=cots[a] if merged and part is None else None)
          else:
            (buf, _, _, row), = run
            part = sources_partial(rows[a0:a0 + b - a], r_ab, buf, rows_t,
                                   lse, xd, lo + off, rows_m, h, init=part,
                                   dx_row=row)
          *part, dtp = settled(part)
          dt = dt.at[lo:lo + rows_m].add(dtp)
        if merged:     # the share into rows 0 .. b-a-1 of the group's buffer
          cots[a] = (part[0] if plan.impl == "triton"
                     else cots[a].at[:b - a].set(part[0]))
        share = (a, *part, rows, a0)
      _, acc, coef, rows, a0 = share
      if merged:       # the buffer as it is now: later rows not yet written
        acc = cots[a]
      init, init_row, m = (acc, coef), i - a, b - i   # rows of the share
      if s_row is None:   # the stacked rows, so the arrays die once stacked
        s, s_row = rows, a0 + i - a
    if not plan.use_buffers:
      ds, dti = _source_grad_lists(s, r, dxs[i:i + m], xds[i:i + m],
                                   tt[i:i + m], lses[i:i + m], h)
      dt = dt.at[i:i + m].add(dti)
      return ds
    parts = cotangents(i, i + m)
    for k, (buf, lo, rows_m, row) in enumerate(parts):
      last = k + 1 == len(parts)       # else: sums for the spans below
      if plan.impl == "triton":
        out = triton_stack.source_grad(
            s, r, buf, rows_t, lse, xd, lo + off, h, plan.mesh,
            plan.batch_axes, m=rows_m, init=init, dx_row=row,
            partial=not last, s_row=s_row, init_row=init_row)
      else:
        out = source_grad(s, r, buf, rows_t, lse, xd, lo + off, h, rows_m,
                          init, row, partial=not last, s_row=s_row,
                          init_row=init_row)
      out = settled(out)
      dt = dt.at[lo:lo + rows_m].add(out[-1])
      init, init_row = out[:2], None  # (acc, coef) unless last: (ds, dt)
    return out[0]

  recomputed = {}      # with norm: sites' outputs, recomputed a group at once

  def routed_input(j, after):
    """Site ``j``'s output ``x_j`` (``j < n``), recomputed (``norm`` given)
    from the sources it reads, as the forward routed it up to rounding, as
    ``(rows, k)`` with ``x_j = rows[k]``: ``rows [G, ..., D]`` the outputs
    of ``j``'s group (the norm kernel reads the row in place; a sliced row
    would be a copy).
    Full method: every site of ``j``'s group (``plan.site_groups``; the
    backward reaches its top site first) in one pass over the sources,
    site k reading ``s_0 .. s_k``; the shared buffer's rows ``0 .. k`` are
    still sources then (row k + 1 is written with site k's cotangent).
    Blocks: site ``j`` alone over the block sums before its block and its
    partial sum. The inverse RMS pass an optimization barrier with
    ``after`` (the gradient of sublayer ``j``'s output), so that XLA
    neither merges the recomputation with the forward's routing (keeping
    its result after all) nor hoists it."""
    if j in recomputed:
      return recomputed.pop(j)
    if not plan.full:
      k = plan.blocks[j] + 1              # s_0 and the finished block sums
      live, live_r = list(done[:k]), list(done_r[:k])
      if partials[j] is not None:
        live, live_r = live + [partials[j]], live_r + [partial_r[j]]
      live_r, _ = jax.lax.optimization_barrier((live_r, after))
      return _sites(live, t[j:j + 1], live_r, plan)[0], 0
    a, b = next(ab for ab in plan.site_groups(n) if ab[0] <= j < ab[1])
    b = min(b, plan.recomputed_sites(n))  # the sites above keep theirs
    r_rows, _ = jax.lax.optimization_barrier((jnp.stack(done_r[:b]), after))
    if not shared and b - a == 1:         # site by site from the list
      return _sites(done[:b], t[j:j + 1], list(r_rows), plan)[0], 0
    if shared and plan.impl == "triton" and _tensor_core_group(
        plan, b - a, g.shape[-1], any_size=True):
      from mhar_jax.kernels import triton_stack
      out, _ = triton_stack.sites(cots[0], r_rows, b, tt[a:b], h, plan.mesh,
                                  plan.batch_axes, causal=True)
    else:
      rows = cots[0][:b] if shared else jnp.stack(done[:b])
      out, _ = _sites_jnp(rows, t[a:b], r_rows, h, causal=True)
    recomputed.update({k: (out, k - a) for k in range(a, b) if k != j})
    return out, j - a

  def settled(outs):
    """``outs`` (read from the cotangent buffers) through an optimization
    barrier: a query-gain gradient (read only at the end) is then computed
    with the source gradient the next write waits for, not later from a
    buffer that write has replaced (XLA would keep a copy of it: with the
    sources' buffer shared, 4 copies at 1b; recomputed sources, 2)."""
    return jax.lax.optimization_barrier(outs)

  # Walk the sublayers down. ``dy`` is the gradient of sublayer j's output:
  # its block sum's gradient (read by every site after the block) plus those
  # of the partial sums after j in its block (each read by one site).
  finished = len(done_r) - 1   # index in ``done`` of the block j ends
  dy = None
  for j in range(n - 1, -1, -1):
    if ends[j]:
      if us is not None and not plan.full:
        recompute_block(j, finished)
      dy = grad_of(finished, j + 1, n - j)
      finished -= 1
    if us is not None:
      dp_project, du = projected.pop(j)[1](dy)
      dparams[j], dx = vjps[j](du)
      dparams[j] = jax.tree.map(jnp.add, dparams[j], dp_project)
      after = dx
    elif norm is not None:     # the norm's gradient at x_j (kept or recomputed)
      x_rows, x_row = ((xs[j][None], 0) if xs[j] is not None
                       else routed_input(j, dy))
      if plan.impl == "triton" and plan.use_buffers and _norm_kernel():
        # one kernel: dx into its buffer row in place, <dx, x_j>, the gain's
        # gradient (XLA's fusions read x_j and dyn or dx three times), from
        # the terms of dyn (the kernel adds them: no array of their sum)
        from mhar_jax.kernels import triton_stack
        (dparams[j], _), dyn = _cotangent_terms(
            vjps[j], dy, int(triton_stack.NORM_TUNING["dy_terms"]))
        scale, scale_vjp = jax.vjp(functools.partial(norm.scale, j),
                                   params[j])
        a, row = row_of(j, dyn[0])
        cots[a], xd_j, dscale = triton_stack.norm_grad(
            x_rows, scale, dyn, norm.eps, h, cots[a], row, plan.mesh,
            plan.batch_axes, x_row=x_row)
        xd = xd.at[j + off].set(xd_j)
        dp_norm = scale_vjp(dscale.astype(scale.dtype))[0]
        dx = None              # written, with <dx, x_j>
      else:
        dparams[j], dyn = vjps[j](dy)
        x_j = x_rows[x_row]
        dp_norm, dx = jax.vjp(functools.partial(norm, j), params[j], x_j)[1](
            dyn)
      dparams[j] = jax.tree.map(jnp.add, dparams[j], dp_norm)
    else:
      dparams[j], dx = vjps[j](dy)
    if dx is not None:
      xd_j = dot_heads(dx, xs[j] if norm is None else x_j, h)
      if plan.use_buffers:
        put(j, dx)
        xd = xd.at[j + off].set(xd_j)
      else:
        dxs[j], xds[j] = dx, xd_j
    if partial_r[j] is not None:
      src = partials[j] if us is None else sums.pop(("site", j))
      dy = dy + _grad_of(src, partial_r[j], j, 1)
  dh = grad_of(0, 0, n + 1)
  # Site 0 reads s_0 alone: its query and gain have exactly zero gradient.
  # The formula leaves rounding noise there (<dx_0, s_0> - xd_0), which
  # Adam would turn into a random walk of parameters that cannot matter.
  dt = dt.at[0].set(0.0).reshape(queries.shape)
  dqueries = (dt * gains.astype(jnp.float32)).astype(queries.dtype)
  dgains = (dt * queries.astype(jnp.float32)).astype(gains.dtype)
  dconsts = jax.tree.map(_zero_cotangent, consts)
  return dh, tuple(dparams), dqueries, dgains, dconsts


def _norm_kernel() -> bool:
  """Whether the Triton path takes the norms' gradients by
  ``triton_stack.norm_grad`` (``NORM_TUNING["kernel"]``)."""
  from mhar_jax.kernels import triton_stack
  return bool(triton_stack.NORM_TUNING["kernel"])


def takes_norm_kernel(impl: str | None) -> bool:
  """Whether :func:`routed_stack` with ``impl`` takes the norms' gradients
  by one kernel a site (Triton, ``triton_stack.NORM_TUNING["kernel"]``):
  only then does passing ``norm`` pay where no site recomputes its output
  (``recompute_below=0``); elsewhere the sublayers keep their norms."""
  from mhar_jax.kernels import resolve_impl
  return resolve_impl(impl) == "triton" and _norm_kernel()


def _zero_cotangent(x):
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, dtype=jax.dtypes.float0)


_stack.defvjp(_stack_fwd, _stack_bwd)
