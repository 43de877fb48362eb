"""The pieces of training as functions: optimiser, loss, state, steps, FLOPs.

The training state is a plain pytree (a dict)::

    {"params": pure dict of float32 parameters (nnx.to_pure_dict layout),
     "opt_state": optax state, "step": int32, "rng": uint32[2] key data,
     "skipped": int32 (total non-finite steps), "consecutive_skips": int32}

and the model's static structure is an ``nnx.GraphDef`` kept beside it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from flax.core import spmd as core_spmd

from mhar_jax.layers import DEFAULT_RULES, Transformer, TransformerConfig
from mhar_jax.layers.router import mean_entropy
from mhar_jax.loss import lm_head_cross_entropy
from mhar_jax.parallel import replicated, state_shardings

State = dict[str, Any]


# -- optimiser ----------------------------------------------------------------

def lr_schedule(t: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warm-up from 0 to ``train.lr``, cosine to ``lr * final_lr_ratio``."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=t.lr, warmup_steps=t.warmup_steps,
      decay_steps=max(t.steps, t.warmup_steps + 1),
      end_value=t.lr * t.final_lr_ratio)


def decay_mask(params, mode: str):
  """Which parameters get weight decay.

  ``matrices``: every parameter with two or more axes except the embedding;
  ``matrices+embedding``: every parameter with two or more axes; ``all``.
  Norm gains, routing queries and gains, gates and HC weights are vectors (or
  HC's small matrices of streams) and are not decayed under ``matrices``.
  """
  def rule(path, x):
    name = jax.tree_util.keystr(path)
    if mode == "all":
      return True
    if "hyper" in name:
      return False
    if "embedding" in name:
      return mode == "matrices+embedding"
    return x.ndim >= 2
  return jax.tree_util.tree_map_with_path(rule, params)


def make_optimizer(t: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Clip by global norm, then AdamW with the warm-up + cosine schedule."""
  return optax.chain(
      optax.clip_by_global_norm(t.clip_norm),
      optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, eps=t.adam_eps,
                  weight_decay=t.weight_decay,
                  mask=functools.partial(decay_mask, mode=t.decay)))


# -- state ----------------------------------------------------------------------

def abstract_params(model_cfg: TransformerConfig) -> nnx.State:
  """The parameters as an abstract ``nnx.State`` (shapes and logical names)."""
  model = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
  return nnx.state(model, nnx.Param)


def fingerprint(model_cfg: TransformerConfig) -> dict:
  """What a checkpoint must match to be resumed: the architecture (not the
  implementation choices routing_impl / routing_backward /
  routing_site_group / attention_impl / remat / recompute_sources /
  recompute_site_outputs)."""
  arch = dataclasses.asdict(model_cfg)
  for k in ("routing_impl", "routing_backward", "routing_site_group",
            "attention_impl", "remat", "recompute_sources",
            "recompute_site_outputs"):
    arch.pop(k)
  return {"model": arch}


def graphdef(model_cfg: TransformerConfig) -> nnx.GraphDef:
  """The model's static structure, to ``nnx.merge`` with a params dict."""
  model = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
  return nnx.split(model, nnx.Param)[0]


def param_shardings(abstract_params, mesh, rules=DEFAULT_RULES):
  """Pure-dict tree of ``NamedSharding`` for the parameters."""
  return nnx.to_pure_dict(state_shardings(abstract_params, mesh, rules))


def _init_fn(model_cfg: TransformerConfig, tx, seed: int):
  def init() -> State:
    model = Transformer(model_cfg, rngs=nnx.Rngs(seed))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return {"params": params, "opt_state": tx.init(params),
            "step": jnp.zeros((), jnp.int32),
            "rng": jax.random.key_data(jax.random.key(seed + 1)),
            "skipped": jnp.zeros((), jnp.int32),
            "consecutive_skips": jnp.zeros((), jnp.int32)}
  return init


def state_shardings_for(model_cfg, tx, mesh, rules=DEFAULT_RULES):
  """Shardings of the whole training state.

  Parameters by their logical names; optimiser leaves that mirror a parameter
  (Adam's moments) share its sharding; everything else is replicated.
  """
  p_sh = param_shardings(abstract_params(model_cfg), mesh, rules)
  shapes = jax.eval_shape(_init_fn(model_cfg, tx, 0))
  by_path = {jax.tree_util.keystr(k): s for k, s in
             jax.tree_util.tree_flatten_with_path(p_sh)[0]}
  rep = replicated(mesh)

  def opt_leaf(path, x):
    key = jax.tree_util.keystr(path)
    best = max((p for p in by_path if key.endswith(p)), key=len, default=None)
    if best is not None and x.ndim == len(by_path[best].spec) and x.ndim:
      return by_path[best]
    return rep

  return {"params": p_sh,
          "opt_state": jax.tree_util.tree_map_with_path(opt_leaf,
                                                        shapes["opt_state"]),
          "step": rep, "rng": rep, "skipped": rep, "consecutive_skips": rep}


def compiled_init(model_cfg: TransformerConfig, tx, seed: int, shardings):
  """The compiled ``() -> State`` initialiser (AOT: its compile can be timed,
  and it lands in JAX's persistent compilation cache when that is on).

  The parameters' threefry draws are lowered to JAX's GPU threefry kernel
  (``jax_threefry_gpu_kernel_lowering``; the same bits): XLA's default GPU
  lowering unrolls each draw into its own large fusion, and with hundreds of
  parameter tensors the initialiser then compiled for minutes at 1b on an
  H200, longer than the train step. No effect on other backends.
  """
  flag = "jax_threefry_gpu_kernel_lowering"
  before = getattr(jax.config, flag)
  jax.config.update(flag, True)
  try:
    with core_spmd.logical_axis_rules(DEFAULT_RULES):
      return jax.jit(_init_fn(model_cfg, tx, seed),
                     out_shardings=shardings).lower().compile()
  finally:
    jax.config.update(flag, before)


def init_state(model_cfg: TransformerConfig, tx, seed: int, shardings) -> State:
  """Builds the training state directly in its shardings (jitted init)."""
  return compiled_init(model_cfg, tx, seed, shardings)()


def abstract_state(model_cfg: TransformerConfig, tx, shardings):
  """``jax.ShapeDtypeStruct`` tree of the state, carrying its shardings."""
  shapes = jax.eval_shape(_init_fn(model_cfg, tx, 0))
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      shapes, shardings)


# -- steps ------------------------------------------------------------------------

def model_loss(model, batch, *, z_loss: float = 0.0, chunk_tokens: int):
  """``(total, ce, z)`` of ``model`` on ``{"inputs", "targets"}`` ``[B, T]``:
  :func:`mhar_jax.loss.lm_head_cross_entropy` of its final hidden states."""
  return lm_head_cross_entropy(model.hidden_states(batch["inputs"]),
                               model.head(), batch["targets"], z_loss=z_loss,
                               chunk_tokens=chunk_tokens)


def _microbatches(batch, accum: int):
  """``[B, T] -> [accum, B/accum, T]`` taking every ``accum``-th row, so each
  data shard keeps its own rows (no resharding)."""
  return jax.tree.map(
      lambda x: x.reshape(x.shape[0] // accum, accum, *x.shape[1:])
      .swapaxes(0, 1), batch)


def make_train_step(gdef: nnx.GraphDef, tx, t: ml_collections.ConfigDict,
                    state_sh, batch_sh):
  """Jitted ``(state, batch) -> (state, metrics)``; the state is donated.

  ``batch``: ``{"inputs", "targets"}`` int32 ``[global_batch, seq_len]``.
  Non-finite loss or gradient norm skips the update on device (parameters
  and optimiser state unchanged) and counts it; the host reads the counters
  when it logs, never every step.
  """
  accum = t.grad_accum
  schedule = lr_schedule(t)

  def loss_fn(params, batch):
    total, ce, z = model_loss(nnx.merge(gdef, params), batch, z_loss=t.z_loss,
                              chunk_tokens=t.loss_chunk_tokens)
    return total, (ce, z)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def step(state: State, batch):
    with core_spmd.logical_axis_rules(DEFAULT_RULES):
      params = state["params"]
      if accum == 1:
        (loss, (ce, z)), grads = grad_fn(params, batch)
      else:
        def body(carry, mb):
          (l, (c, zz)), g = grad_fn(params, mb)
          return jax.tree.map(jnp.add, carry, (g, l, c, zz)), None
        zero = (jax.tree.map(jnp.zeros_like, params), 0.0, 0.0, 0.0)
        (grads, loss, ce, z), _ = jax.lax.scan(body, zero,
                                               _microbatches(batch, accum))
        grads, loss, ce, z = jax.tree.map(lambda x: x / accum,
                                          (grads, loss, ce, z))
      grad_norm = optax.tree.norm(grads)
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

      def apply(_):
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        return optax.apply_updates(params, updates), opt_state

      params, opt_state = jax.lax.cond(
          finite, apply, lambda _: (params, state["opt_state"]), None)
      rng = jax.random.key_data(jax.random.fold_in(
          jax.random.wrap_key_data(state["rng"]), state["step"]))
      new = {"params": params, "opt_state": opt_state,
             "step": state["step"] + 1, "rng": rng,
             "skipped": state["skipped"] + (~finite).astype(jnp.int32),
             "consecutive_skips": jnp.where(
                 finite, 0, state["consecutive_skips"] + 1)}
      metrics = {"loss": ce, "z_loss": z, "grad_norm": grad_norm,
                 "lr": schedule(state["step"]), "skipped": new["skipped"],
                 "consecutive_skips": new["consecutive_skips"]}
    return new, metrics

  return jax.jit(step, in_shardings=(state_sh, batch_sh),
                 out_shardings=(state_sh, None), donate_argnums=(0,))


def make_eval_step(gdef: nnx.GraphDef, params_sh, batch_sh,
                   chunk_tokens: int):
  """Jitted ``(params, batch) -> mean cross entropy`` (nats per token);
  ``chunk_tokens`` as ``train.loss_chunk_tokens``."""
  def step(params, batch):
    with core_spmd.logical_axis_rules(DEFAULT_RULES):
      return model_loss(nnx.merge(gdef, params), batch,
                        chunk_tokens=chunk_tokens)[1]
  return jax.jit(step, in_shardings=(params_sh, batch_sh))


def make_routing_stats(gdef: nnx.GraphDef, params_sh, batch_sh):
  """Jitted ``(params, inputs) -> [sites]`` mean routing entropy (nats)."""
  def stats(params, inputs):
    with core_spmd.logical_axis_rules(DEFAULT_RULES):
      _, routing = nnx.merge(gdef, params)(inputs, return_routing=True)
      return jnp.stack([mean_entropy(w) for w in routing])
  return jax.jit(stats, in_shardings=(params_sh, batch_sh))


# -- accounting -----------------------------------------------------------------

def matmul_params(cfg: TransformerConfig) -> int:
  """Parameters that take part in matrix products per token (incl. LM head)."""
  attn = cfg.d_model * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
  mlp = 3 * cfg.d_model * cfg.ffn_dim
  return cfg.num_layers * (attn + mlp) + cfg.vocab_size * cfg.d_model


def flops_per_token(cfg: TransformerConfig, seq_len: int) -> float:
  """Training FLOPs per token: ``6 N + 6 L H_q d_h T``.

  ``N`` = :func:`matmul_params` (forward 2N, backward 4N); the second term is
  causal attention (QK^T and AV, forward + backward, half the T x T square).
  Routing and norms are memory-bound and not counted.
  """
  return (6 * matmul_params(cfg)
          + 6 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len)


PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12,
                   "B200": 2250e12}


def peak_flops(device) -> float | None:
  """Dense bf16 peak of one device, or None when unknown (e.g. CPU)."""
  kind = getattr(device, "device_kind", "")
  for name, peak in PEAK_BF16_FLOPS.items():
    if name in kind:
      return peak
  return None
