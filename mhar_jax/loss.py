"""The language-model loss, computed from the LM head's input without the logits.

:func:`lm_head_cross_entropy` takes the final hidden states ``x [B, T, D]``,
the head ``[V, D]`` and the targets, and returns the mean next-token cross
entropy and z-loss of ``logits = x @ headᵀ`` (float32 accumulation). It never
holds the ``[B, T, V]`` logits: the tokens go through the head in chunks of
sequence positions (``lax.scan``), and when differentiated each chunk's
gradients (``dx``, and ``dhead`` summed over chunks in float32) are formed in
the forward pass from the chunk's softmax, so the backward only scales them.
Same three matmuls as the unfused head (no recomputation); peak memory one
chunk's logits instead of the whole microbatch's float32 logits and their
cotangent (18.5 + 9.3 GiB at the 1b preset's 32k-token microbatch).

Under a mesh with logical axis rules (:mod:`mhar_jax.layers.sharding`) it
runs in ``shard_map``: rows over the ``activation_batch`` axes, the head's
vocabulary over the ``activation_vocab`` axis (the log-sum-exp, the target
logit and ``dx`` reduced over it), ``dhead`` reduce-scattered over the batch
axes once, after the last chunk.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax.core import spmd as core_spmd
from jax.sharding import PartitionSpec as P

# Tokens per device per chunk by default (``train.loss_chunk_tokens``): one
# chunk's float32 logits are 1.2 GiB at vocabulary 151,936.
CHUNK_TOKENS = 2048


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static arguments: the z-loss coefficient, chunk budget and sharding."""
  z_loss: float
  chunk_tokens: int
  num_tokens: int                      # B * T over the whole (global) batch
  mesh: object = None                  # shard_map over this mesh, or None
  batch_axes: tuple = ()
  vocab_axis: str | None = None
  scatter_head: bool = False           # dhead reduce-scattered along D


def lm_head_cross_entropy(x: jax.Array, head: jax.Array, targets: jax.Array,
                          *, z_loss: float = 0.0,
                          chunk_tokens: int = CHUNK_TOKENS):
  """Mean cross entropy (nats) and z-loss of the logits ``x @ headᵀ``.

  Args:
    x: ``[B, T, D]`` final hidden states (after the final norm), in the
      compute dtype.
    head: ``[V, D]`` LM head (the tied embedding or a separate matrix), in
      the same dtype.
    targets: ``[B, T]`` int, in ``[0, V)``.
    z_loss: coefficient of ``mean(logsumexp²)`` in ``total``.
    chunk_tokens: tokens per device per chunk: each chunk covers
      ``c`` sequence positions of every local row, ``c`` the largest divisor
      of T with ``rows * c <= chunk_tokens`` (at least 1). One chunk's float32
      logits (``4 * chunk_tokens * V`` bytes) bound the transient memory.

  Returns:
    ``(total, ce, z)`` float32 scalars: ``ce = mean(lse - logit[target])``,
    ``z = mean(lse²)``, ``total = ce + z_loss * z``. Only ``total`` is
    differentiable (in ``x`` and ``head``); ``ce`` and ``z`` are for logging
    and carry no gradient.

  The gradient equals autodiff of the plain formula with the logits'
  cotangent rounded to the compute dtype before the two matmuls (as
  :func:`mhar_jax.layers.basic.project_logits` does).
  """
  if x.ndim != 3 or head.ndim != 2 or x.shape[-1] != head.shape[-1]:
    raise ValueError(f"lm_head_cross_entropy: x {x.shape} must be [B, T, D]"
                     f" and head {head.shape} [V, D] with the same D.")
  if targets.shape != x.shape[:2]:
    raise ValueError(f"lm_head_cross_entropy: targets {targets.shape} must be"
                     f" x's [B, T] = {x.shape[:2]}.")
  if x.dtype != head.dtype:
    raise ValueError(f"lm_head_cross_entropy: x is {x.dtype} and head"
                     f" {head.dtype}; cast both to the compute dtype.")
  if chunk_tokens < 1:
    raise ValueError(f"chunk_tokens={chunk_tokens}: must be positive.")
  plan = _sharding_plan(x, head, _Plan(float(z_loss), int(chunk_tokens),
                                       x.shape[0] * x.shape[1]))
  total, ce, z = _fused(x, head, targets, plan)
  return total, jax.lax.stop_gradient(ce), jax.lax.stop_gradient(z)


def _sharding_plan(x, head, plan: _Plan) -> _Plan:
  """Fills the mesh fields from the context's mesh and logical axis rules
  (none without both, or when every mesh axis has size 1)."""
  mesh = jax.sharding.get_abstract_mesh()
  rules = dict(core_spmd.get_logical_axis_rules() or ())
  if (not rules or mesh is None or mesh.empty
      or all(v == 1 for v in mesh.shape.values())):
    return plan

  def axes(name):
    a = rules.get(name)
    a = (a,) if isinstance(a, str) else tuple(a or ())
    return tuple(n for n in a if n in mesh.shape and mesh.shape[n] > 1)

  batch = axes("activation_batch")
  if x.shape[0] % math.prod(mesh.shape[a] for a in batch):
    batch = ()
  vocab = axes("activation_vocab")
  vocab_axis = vocab[0] if len(vocab) == 1 else None
  if vocab_axis in batch or (
      vocab_axis and head.shape[0] % mesh.shape[vocab_axis]):
    vocab_axis = None
  scatter = bool(batch) and (
      x.shape[-1] % math.prod(mesh.shape[a] for a in batch) == 0)
  return dataclasses.replace(plan, mesh=mesh, batch_axes=batch,
                             vocab_axis=vocab_axis, scatter_head=scatter)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fused(x, head, targets, plan):
  return _run(x, head, targets, plan, with_grads=False)[:3]


def _fused_fwd(x, head, targets, plan):
  total, ce, z, dx, dhead = _run(x, head, targets, plan, with_grads=True)
  return (total, ce, z), (dx, dhead)


def _fused_bwd(plan, res, g):
  # ce and z leave lm_head_cross_entropy through stop_gradient: their
  # cotangents are zero, and total's scales the gradients made in the forward.
  dx, dhead = res
  g_total = g[0]
  return ((g_total * dx).astype(dx.dtype),
          (g_total * dhead).astype(dhead.dtype), None)


_fused.defvjp(_fused_fwd, _fused_bwd)


def _run(x, head, targets, plan: _Plan, *, with_grads: bool):
  """``(total, ce, z[, dx, dhead])``, in ``shard_map`` when ``plan.mesh``."""
  local = functools.partial(_local, plan=plan, with_grads=with_grads)
  if plan.mesh is None:
    return local(x, head, targets)
  rows = (plan.batch_axes if len(plan.batch_axes) > 1
          else (plan.batch_axes[0] if plan.batch_axes else None))
  out_specs = (P(), P(), P())
  if with_grads:
    out_specs += (P(rows), P(plan.vocab_axis, rows if plan.scatter_head
                             else None))
  return jax.shard_map(
      local, mesh=plan.mesh,
      in_specs=(P(rows), P(plan.vocab_axis), P(rows)),
      out_specs=out_specs, check_vma=False)(x, head, targets)


def _chunk_positions(rows: int, length: int, chunk_tokens: int) -> int:
  """The largest divisor ``c`` of ``length`` with ``rows * c <= chunk_tokens``."""
  best = 1
  for c in range(1, length + 1):
    if length % c == 0 and rows * c <= chunk_tokens:
      best = c
  return best


def _local(x, head, targets, *, plan: _Plan, with_grads: bool):
  """One device's rows and vocabulary slice: scan over position chunks."""
  b, t, d = x.shape
  v = head.shape[0]
  vocab_axis = plan.vocab_axis
  v0 = jax.lax.axis_index(vocab_axis) * v if vocab_axis else 0
  c = _chunk_positions(b, t, plan.chunk_tokens)
  n = t // c
  xs = x.reshape(b, n, c, d).swapaxes(0, 1)          # [n, b, c, D]
  ts = targets.reshape(b, n, c).swapaxes(0, 1) - v0  # local vocabulary ids
  inv_n = 1.0 / plan.num_tokens

  def over_vocab(f, y):
    return f(y, vocab_axis) if vocab_axis else y

  def chunk(dhead, xt):
    xc, tc = xt
    logits = jnp.einsum("bcd,vd->bcv", xc, head,
                        preferred_element_type=jnp.float32)
    m = over_vocab(jax.lax.pmax, jnp.max(logits, axis=-1))
    e = jnp.exp(logits - m[..., None])
    lse = m + jnp.log(over_vocab(jax.lax.psum, jnp.sum(e, axis=-1)))
    hit = (tc >= 0) & (tc < v)
    tl = jnp.take_along_axis(logits, jnp.clip(tc, 0, v - 1)[..., None],
                             -1)[..., 0]
    tl = over_vocab(jax.lax.psum, jnp.where(hit, tl, 0.0))
    sums = (jnp.sum(lse - tl), jnp.sum(lse * lse))
    if not with_grads:
      return dhead, sums
    # d total / d logits = (p (1 + 2 z_loss lse) - onehot) / N
    # (p = e * exp(m - lse), m the row maximum)
    scale = jnp.exp(m - lse) * (1.0 + 2.0 * plan.z_loss * lse) * inv_n
    onehot = tc[..., None] == jnp.arange(v, dtype=tc.dtype)
    dlogits = (e * scale[..., None]
               - jnp.where(onehot, inv_n, 0.0)).astype(x.dtype)
    dxc = over_vocab(jax.lax.psum, jnp.einsum(
        "bcv,vd->bcd", dlogits, head, preferred_element_type=jnp.float32))
    dhead = dhead + jnp.einsum("bcv,bcd->vd", dlogits, xc,
                               preferred_element_type=jnp.float32)
    return dhead, sums + (dxc.astype(x.dtype),)

  dhead0 = jnp.zeros((v, d), jnp.float32) if with_grads else None
  dhead, out = jax.lax.scan(chunk, dhead0, (xs, ts))
  ce_sum, z_sum = jnp.sum(out[0]), jnp.sum(out[1])
  if plan.batch_axes:
    ce_sum, z_sum = jax.lax.psum((ce_sum, z_sum), plan.batch_axes)
  ce, z = ce_sum * inv_n, z_sum * inv_n
  total = ce + plan.z_loss * z
  if not with_grads:
    return total, ce, z
  dx = out[2].swapaxes(0, 1).reshape(b, t, d)
  if plan.scatter_head:
    dhead = jax.lax.psum_scatter(dhead, plan.batch_axes, scatter_dimension=1,
                                 tiled=True)
  elif plan.batch_axes:
    dhead = jax.lax.psum(dhead, plan.batch_axes)
  return total, ce, z, dx, dhead.astype(head.dtype)
