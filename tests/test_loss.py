"""The chunked LM head + loss against autodiff of the plain formula, on one
device and on forced-CPU meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.core import spmd as core_spmd
from jax.sharding import NamedSharding, PartitionSpec as P

from mhar_jax.layers import DEFAULT_RULES, Transformer, TransformerConfig
from mhar_jax.layers.basic import project_logits
from mhar_jax.loss import lm_head_cross_entropy
from mhar_jax.parallel import make_mesh


def plain(x, head, targets, z_loss=0.0):
  """The formula on the whole logits; the head's backward as project_logits."""
  logits = project_logits(x, head)
  lse = jax.nn.logsumexp(logits, axis=-1)
  tl = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
  ce, z = jnp.mean(lse - tl), jnp.mean(lse**2)
  return ce + z_loss * z, ce, z


def inputs(b, t, d, v, dtype=jnp.float32, seed=0):
  k = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(k[0], (b, t, d)).astype(dtype)
  head = (2 * jax.random.normal(k[1], (v, d)) / np.sqrt(d)).astype(dtype)
  return x, head, jax.random.randint(k[2], (b, t), 0, v)


def value_and_grads(fn, x, head, targets, z_loss, **kw):
  def total(x, head):
    out = fn(x, head, targets, z_loss=z_loss, **kw)
    return out[0], out
  (_, out), g = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(
      x, head)
  return out, g


@pytest.mark.parametrize("z_loss", [0.0, 1e-4, 0.3])
@pytest.mark.parametrize("chunk_tokens", [1, 9, 21, 10_000])
def test_matches_autodiff_float32(z_loss, chunk_tokens):
  # T = 7 (prime): chunk budgets give 1, 3 (9 // 3 rows), 7 positions
  x, head, targets = inputs(3, 7, 16, 53)
  out, g = value_and_grads(lm_head_cross_entropy, x, head, targets, z_loss,
                           chunk_tokens=chunk_tokens)
  out_ref, g_ref = value_and_grads(plain, x, head, targets, z_loss)
  np.testing.assert_allclose(out, out_ref, rtol=1e-6)
  for a, r in zip(g, g_ref):
    np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5 * np.abs(r).max())


def test_bfloat16_within_tolerance_and_dtypes_kept():
  x, head, targets = inputs(4, 16, 32, 101, jnp.bfloat16, seed=1)
  out, g = value_and_grads(lm_head_cross_entropy, x, head, targets, 1e-4,
                           chunk_tokens=16)
  out_ref, g_ref = value_and_grads(plain, x, head, targets, 1e-4)
  assert [a.dtype for a in g] == [jnp.bfloat16, jnp.bfloat16]
  np.testing.assert_allclose(out, out_ref, rtol=1e-5)
  for a, r in zip(g, g_ref):
    a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
    assert np.abs(a - r).max() <= 1e-2 * np.abs(r).max()


def test_large_logits_do_not_overflow():
  x, head, targets = inputs(2, 4, 8, 19)
  out, g = value_and_grads(lm_head_cross_entropy, 40 * x, head, targets, 0.0,
                           chunk_tokens=2)
  out_ref, g_ref = value_and_grads(plain, 40 * x, head, targets, 0.0)
  assert all(np.isfinite(a).all() for a in g)
  np.testing.assert_allclose(out, out_ref, rtol=1e-5)
  np.testing.assert_allclose(g[0], g_ref[0], rtol=1e-4, atol=1e-6)


def test_never_builds_the_whole_logits():
  """With 4 chunks no array in the gradient's program has B*T*V elements
  (the unfused head makes several)."""
  b, t, v = 2, 16, 64
  x, head, targets = inputs(b, t, 8, v)
  grad = jax.grad(lambda x, h: lm_head_cross_entropy(
      x, h, targets, chunk_tokens=b * t // 4)[0], argnums=(0, 1))
  sizes = [a.aval.size for a in _all_outvars(jax.make_jaxpr(grad)(x, head))]
  assert max(sizes) == b * t * v // 4
  ref = jax.grad(lambda x, h: plain(x, h, targets)[0], argnums=(0, 1))
  assert b * t * v in [a.aval.size for a in
                       _all_outvars(jax.make_jaxpr(ref)(x, head))]


def _all_outvars(jaxpr):
  """Every equation's outputs, in nested jaxprs (scan bodies) too."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    yield from eqn.outvars
    for p in eqn.params.values():
      for q in (p if isinstance(p, (tuple, list)) else (p,)):
        if isinstance(getattr(q, "jaxpr", q), jax.extend.core.Jaxpr):
          yield from _all_outvars(q)


def test_ce_and_z_carry_no_gradient():
  x, head, targets = inputs(2, 4, 8, 19)
  g = jax.grad(lambda x: lm_head_cross_entropy(x, head, targets,
                                               z_loss=0.1)[1])(x)
  assert not np.asarray(g).any()


@pytest.mark.parametrize("data,model,b,v", [
    (4, 2, 8, 64),    # rows over data, vocabulary over model, dhead scattered
    (2, 4, 2, 60),    # vocabulary over model
    (8, 1, 8, 37),    # data only
    (2, 4, 3, 37),    # neither divides: rows and vocabulary replicated
])
def test_sharded_equals_unsharded(data, model, b, v):
  if jax.default_backend() != "cpu" and len(jax.devices()) < 8:
    pytest.skip("needs 8 devices (on the CPU, conftest forces them)")
  assert len(jax.devices()) >= 8, "conftest forces 8 CPU devices"
  x, head, targets = inputs(b, 12, 16, v, seed=2)
  mesh = make_mesh(data, model, jax.devices()[:8])

  @jax.jit
  def run(x, head, targets):
    with core_spmd.logical_axis_rules(DEFAULT_RULES):
      return value_and_grads(lm_head_cross_entropy, x, head, targets, 1e-3,
                             chunk_tokens=8)

  rows = NamedSharding(mesh, P("data") if b % data == 0 else P())
  with jax.set_mesh(mesh):
    out, g = run(jax.device_put(x, rows),
                 jax.device_put(head, NamedSharding(mesh, P())),
                 jax.device_put(targets, rows))
  out_ref, g_ref = value_and_grads(plain, x, head, targets, 1e-3)
  np.testing.assert_allclose(out, out_ref, rtol=1e-5)
  for a, r in zip(g, g_ref):
    np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5 * np.abs(r).max())


@pytest.mark.parametrize("tie", [True, False])
def test_model_loss_equals_loss_of_the_logits(tie):
  from mhar_jax.training import model_loss
  cfg = TransformerConfig(vocab_size=50, d_model=32, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=48,
                          max_seq_len=16, residual="mhar", routing_heads=4,
                          dtype="float32", tie_embeddings=tie)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  toks = jax.random.randint(jax.random.key(5), (2, 11), 0, 50)
  batch = {"inputs": toks, "targets": jnp.roll(toks, -1, axis=1)}
  graphdef, params = nnx.split(model)

  def loss(params, fn):
    return fn(nnx.merge(graphdef, params))

  def fused(m):
    return model_loss(m, batch, z_loss=1e-3, chunk_tokens=6)[0]

  def unfused(m):
    logits = m(batch["inputs"])
    lse = jax.nn.logsumexp(logits, axis=-1)
    tl = jnp.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
    return jnp.mean(lse - tl) + 1e-3 * jnp.mean(lse**2)

  v, g = jax.value_and_grad(loss)(params, fused)
  v_ref, g_ref = jax.value_and_grad(loss)(params, unfused)
  np.testing.assert_allclose(v, v_ref, rtol=1e-6)
  for a, r in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-6)


def test_bad_arguments_say_what_to_do():
  x, head, targets = inputs(2, 4, 8, 19)
  with pytest.raises(ValueError, match="cast both"):
    lm_head_cross_entropy(x, head.astype(jnp.bfloat16), targets)
  with pytest.raises(ValueError, match="targets"):
    lm_head_cross_entropy(x, head, targets[:, :3])
  with pytest.raises(ValueError, match="chunk_tokens=0"):
    lm_head_cross_entropy(x, head, targets, chunk_tokens=0)
