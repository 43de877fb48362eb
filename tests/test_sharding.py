"""Sharded execution on forced CPU devices, and the routing history's memory cost."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.core import spmd as core_spmd

from mhar_jax.layers import DEFAULT_RULES, Transformer, TransformerConfig
from mhar_jax.parallel import batch_sharding, make_mesh, state_shardings


def cfg(**kw):
  base = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=8, ffn_dim=48, max_seq_len=16,
              residual="mhar", routing_heads=4, dtype="float32")
  base.update(kw)
  return TransformerConfig(**base)


def sharded_forward(model, toks, mesh):
  graphdef, state = nnx.split(model)
  state = jax.device_put(state, state_shardings(state, mesh))

  @jax.jit
  def fwd(state, toks):
    with core_spmd.logical_axis_rules(DEFAULT_RULES):
      return nnx.merge(graphdef, state)(toks)

  with jax.set_mesh(mesh):
    return fwd(state, jax.device_put(toks, batch_sharding(mesh))), state


@pytest.mark.parametrize("residual,blocks", [("mhar", 0), ("prenorm", 0),
                                             ("mhar", 2), ("hyper", 0)])
def test_forward_on_data4_model2_mesh_equals_unsharded(residual, blocks):
  assert len(jax.devices()) >= 8, "conftest forces 8 CPU devices"
  model = Transformer(cfg(residual=residual, num_blocks=blocks), rngs=nnx.Rngs(0))
  if residual == "mhar":
    for i, r in enumerate(model.routers):
      r.query[...] = jax.random.normal(jax.random.key(i), r.query.shape)
  toks = jax.random.randint(jax.random.key(1), (8, 12), 0, 64)
  want = model(toks)
  mesh = make_mesh(4, 2, jax.devices()[:8])
  got, state = sharded_forward(model, toks, mesh)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # parameters really are split: the embedding over (model, data)
  emb = state["embedding"][...]
  assert tuple(emb.sharding.spec) == ("model", "data")
  assert emb.addressable_shards[0].data.shape == (32, 8)


def train_step_temp_bytes(num_layers, residual="mhar"):
  """XLA's temp-buffer estimate for a compiled forward+backward+AdamW step."""
  c = cfg(d_model=64, num_heads=4, head_dim=16, ffn_dim=128, vocab_size=64,
          num_layers=num_layers, residual=residual, routing_heads=4,
          max_seq_len=256)
  model = nnx.eval_shape(lambda: Transformer(c, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(model, nnx.Param)
  opt = optax.adamw(1e-3)
  opt_state = jax.eval_shape(opt.init, params)
  toks = jax.ShapeDtypeStruct((4, 256), jnp.int32)

  def step(params, opt_state, toks):
    def loss(p):
      logits = nnx.merge(graphdef, p)(toks)
      return optax.softmax_cross_entropy_with_integer_labels(logits, toks).mean()
    g = jax.grad(loss)(params)
    upd, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, upd), opt_state

  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
      params, opt_state, toks).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_history_memory_is_linear_in_depth():
  """Doubling depth twice: a quadratic history would quadruple the increment."""
  m = {n: train_step_temp_bytes(n) for n in (1, 2, 4)}
  growth = (m[4] - m[2]) / (m[2] - m[1])
  assert growth < 2.5, m
  base = train_step_temp_bytes(4, "prenorm")
  # one site's stacked float32 temporaries on top of the baseline, no more
  assert m[4] < 2 * base, (m, base)
