"""Transformer building blocks: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Every parameter carries logical axis names (``out_sharding`` metadata, see
:mod:`mhar_jax.layers.sharding`); parameters are stored in ``param_dtype`` and
cast to the compute ``dtype`` at use.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from mhar_jax.kernels.reference import rms_norm
from mhar_jax.layers.sharding import BTD, constrain

Dtype = Any


def param(rngs: nnx.Rngs | None, init, shape, names, dtype) -> nnx.Param:
  """An ``nnx.Param`` of ``shape`` with logical axis ``names``.

  Sharding is recorded, not applied eagerly, so modules build outside a mesh.
  """
  init = nnx.with_partitioning(init, names, eager_sharding=False)
  key = rngs.params() if rngs is not None else jax.random.key(0)
  return nnx.Param(init(key, shape, dtype))


def normal(std: float):
  return nnx.initializers.normal(std)


class RMSNorm(nnx.Module):
  """``x * rsqrt(mean(x^2) + eps) * scale`` over the last axis (float32 math).

  Input ``[..., dim]``; output the input's dtype. ``scale`` starts at ones.
  """

  def __init__(self, dim: int, *, eps: float = 1e-6,
               param_dtype: Dtype = jnp.float32, rngs: nnx.Rngs | None = None):
    self.eps = eps
    self.scale = param(rngs, nnx.initializers.ones, (dim,), ("norm",),
                       param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.scale[...], self.eps)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding (rotate-half form) on ``x [B, T, H, hd]``.

  ``positions``: ``[B, T]`` integer positions. Float32 math, input dtype out.
  """
  hd = x.shape[-1]
  if hd % 2:
    raise ValueError(f"RoPE needs an even head_dim, got {hd}.")
  freq = theta ** (-jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)   # [hd/2]
  angle = positions.astype(jnp.float32)[..., None] * freq           # [B,T,hd/2]
  sin = jnp.sin(angle)[:, :, None, :]
  cos = jnp.cos(angle)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., : hd // 2], x32[..., hd // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class Attention(nnx.Module):
  """Causal grouped-query self-attention with per-head QK-RMSNorm and RoPE.

  ``qk_norm=False`` drops the QK-RMSNorm (and its parameters): Llama style.

  ``x [B, T, D] -> [B, T, D]``. ``num_heads`` query heads share
  ``num_kv_heads`` key/value heads. The core is ``jax.nn.dot_product_attention``
  with ``implementation`` ``"xla"``, ``"cudnn"`` or ``None`` (cuDNN on GPU
  for bf16/fp16, XLA otherwise).
  """

  def __init__(self, dim: int, num_heads: int, num_kv_heads: int,
               head_dim: int, *, rope_theta: float = 1e4, eps: float = 1e-6,
               init_std: float = 0.02, implementation: str | None = None,
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32,
               qk_norm: bool = True, rngs: nnx.Rngs):
    if num_heads % num_kv_heads:
      raise ValueError(
          f"model.num_kv_heads={num_kv_heads} must divide"
          f" model.num_heads={num_heads}.")
    self.num_heads, self.num_kv_heads, self.head_dim = (num_heads,
                                                        num_kv_heads, head_dim)
    self.rope_theta, self.implementation, self.dtype = (rope_theta,
                                                        implementation, dtype)
    init = normal(init_std)
    self.wq = param(rngs, init, (dim, num_heads, head_dim),
                    ("embed", "q_heads", "head_dim"), param_dtype)
    self.wk = param(rngs, init, (dim, num_kv_heads, head_dim),
                    ("embed", "kv_heads", "head_dim"), param_dtype)
    self.wv = param(rngs, init, (dim, num_kv_heads, head_dim),
                    ("embed", "kv_heads", "head_dim"), param_dtype)
    self.wo = param(rngs, init, (num_heads, head_dim, dim),
                    ("q_heads", "head_dim", "embed"), param_dtype)
    self.qk_norm = qk_norm
    if qk_norm:
      self.q_norm = RMSNorm(head_dim, eps=eps, param_dtype=param_dtype,
                            rngs=rngs)
      self.k_norm = RMSNorm(head_dim, eps=eps, param_dtype=param_dtype,
                            rngs=rngs)

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    return self.project(self.heads(x, positions))

  def heads(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """Every head's attention output before ``W_o``: ``[B, T, H, K]``."""
    dt = self.dtype
    x = x.astype(dt)
    q = jnp.einsum("btd,dhk->bthk", x, self.wq[...].astype(dt))
    k = jnp.einsum("btd,dhk->bthk", x, self.wk[...].astype(dt))
    v = jnp.einsum("btd,dhk->bthk", x, self.wv[...].astype(dt))
    q = constrain(q, ("activation_batch", "activation_length",
                      "activation_heads", None))
    k = constrain(k, ("activation_batch", "activation_length",
                      "activation_kv_heads", None))
    if self.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q = apply_rope(q, positions, self.rope_theta)
    k = apply_rope(k, positions, self.rope_theta)
    impl = self.implementation
    if impl is None:     # cuDNN flash attention where it applies, else XLA
      impl = ("cudnn" if jax.default_backend() == "gpu"
              and q.dtype in (jnp.bfloat16, jnp.float16) else "xla")
    return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                        implementation=impl)

  def project(self, o: jax.Array) -> jax.Array:
    """The output projection ``[B, T, H, K] @ W_o -> [B, T, D]``."""
    out = jnp.einsum("bthk,hkd->btd", o, self.wo[...].astype(self.dtype))
    return constrain(out, BTD)


class SwiGLU(nnx.Module):
  """``(silu(x W_gate) * (x W_up)) W_down``: ``[B, T, D] -> [B, T, D]``."""

  def __init__(self, dim: int, hidden: int, *, init_std: float = 0.02,
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32,
               rngs: nnx.Rngs):
    self.dtype = dtype
    init = normal(init_std)
    self.w_gate = param(rngs, init, (dim, hidden), ("embed", "mlp"),
                        param_dtype)
    self.w_up = param(rngs, init, (dim, hidden), ("embed", "mlp"), param_dtype)
    self.w_down = param(rngs, init, (hidden, dim), ("mlp", "embed"),
                        param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.project(self.hidden(x))

  def hidden(self, x: jax.Array) -> jax.Array:
    """``silu(x W_gate) * (x W_up)``: ``[B, T, D] -> [B, T, F]``."""
    dt = self.dtype
    x = x.astype(dt)
    h = (jax.nn.silu(x @ self.w_gate[...].astype(dt))
         * (x @ self.w_up[...].astype(dt)))
    return constrain(h, ("activation_batch", "activation_length",
                         "activation_mlp"))

  def project(self, h: jax.Array) -> jax.Array:
    """The down projection ``[B, T, F] @ W_down -> [B, T, D]``."""
    return constrain(h @ self.w_down[...].astype(self.dtype), BTD)


@jax.custom_vjp
def project_logits(x: jax.Array, head: jax.Array) -> jax.Array:
  """LM-head logits ``x [B, T, D] @ head [V, D]ᵀ -> [B, T, V]`` in float32.

  The matmul runs in the inputs' dtype with float32 accumulation and output.
  Its gradients do too: the float32 cotangent is rounded to the inputs' dtype
  before the two backward matmuls (as mixed-precision training does for
  every other matmul). Plain autodiff of the float32-output einsum would
  upcast the weights instead and run both backward matmuls in float32/TF32,
  at several times the cost of the bf16 ones for a large vocabulary.
  """
  return jnp.einsum("btd,vd->btv", x, head, preferred_element_type=jnp.float32)


def _project_logits_fwd(x, head):
  return jnp.einsum("btd,vd->btv", x, head,
                    preferred_element_type=jnp.float32), (x, head)


def _project_logits_bwd(res, g):
  x, head = res
  g = g.astype(x.dtype)
  dx = jnp.einsum("btv,vd->btd", g, head, preferred_element_type=jnp.float32)
  dhead = jnp.einsum("btv,btd->vd", g, x, preferred_element_type=jnp.float32)
  return dx.astype(x.dtype), dhead.astype(head.dtype)


project_logits.defvjp(_project_logits_fwd, _project_logits_bwd)
