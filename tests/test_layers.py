"""Modules and the decoder: shapes, dtypes, schemes, parameter counts, validation."""

import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

from mhar_jax import kernels
from mhar_jax.layers import (Attention, DepthRouter, HyperConnection, RMSNorm,
                             SwiGLU, Transformer, TransformerConfig,
                             count_params)
from mhar_jax.layers.basic import project_logits

ROOT = pathlib.Path(__file__).resolve().parents[1]


def small(**kw):
  base = dict(vocab_size=61, d_model=32, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=8, ffn_dim=48, max_seq_len=16,
              routing_heads=4, dtype="float32")
  base.update(kw)
  return TransformerConfig(**base)


def tokens(b=2, t=7, v=61, seed=1):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, v)


def randomize_routers(model, seed=0):
  """Non-zero queries and non-unit gains, so routing is not the uniform mean."""
  key = jax.random.key(seed)
  for i, r in enumerate(model.routers):
    k1, k2 = jax.random.split(jax.random.fold_in(key, i))
    r.query[...] = 3.0 * jax.random.normal(k1, r.query.shape)
    r.norm_scale[...] = 1 + 0.5 * jax.random.normal(k2, r.norm_scale.shape)


def test_building_blocks_shapes_and_dtypes():
  rngs = nnx.Rngs(0)
  x = jax.random.normal(jax.random.key(0), (2, 5, 32))
  pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
  for dt in (jnp.float32, jnp.bfloat16):
    xd = x.astype(dt)
    chex.assert_type(RMSNorm(32, rngs=rngs)(xd), dt)
    attn = Attention(32, 4, 2, 8, dtype=dt, rngs=rngs)
    chex.assert_shape(attn(xd, pos), (2, 5, 32))
    chex.assert_type(attn(xd, pos), dt)
    mlp = SwiGLU(32, 48, dtype=dt, rngs=rngs)
    chex.assert_shape(mlp(xd), (2, 5, 32))
    chex.assert_type(mlp(xd), dt)
    router = DepthRouter(32, 4, rngs=rngs)
    out = router([xd, 2 * xd, -xd])
    chex.assert_shape(out, (2, 5, 32))
    chex.assert_type(out, dt)
    chex.assert_shape(router.weights([xd, xd]), (2, 2, 5, 4))
  hc = HyperConnection(4, 5)
  h = jax.random.normal(jax.random.key(1), (2, 5, 4, 32))
  chex.assert_shape(hc.read(h), (2, 5, 32))
  np.testing.assert_allclose(hc.read(h), h[:, :, 1])   # one-hot at 5 mod 4
  chex.assert_shape(hc.write(h, x), (2, 5, 4, 32))


def test_project_logits_gradients_run_in_the_input_dtype():
  kx, kh, kg = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (2, 5, 32))
  head = jax.random.normal(kh, (61, 32))
  g = jax.random.normal(kg, (2, 5, 61))
  plain = lambda x, h: jnp.einsum("btd,vd->btv", x, h,
                                  preferred_element_type=jnp.float32)
  # float32: exactly the plain einsum, values and gradients.
  y, vjp = jax.vjp(project_logits, x, head)
  y0, vjp0 = jax.vjp(plain, x, head)
  np.testing.assert_allclose(y, y0, rtol=1e-6)
  for a, b in zip(vjp(g), vjp0(g)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  # bf16: float32 logits; gradients in bf16 within bf16 rounding of float32.
  xb, hb = x.astype(jnp.bfloat16), head.astype(jnp.bfloat16)
  yb, vjpb = jax.vjp(project_logits, xb, hb)
  assert yb.dtype == jnp.float32
  dx, dh = vjpb(g)
  assert dx.dtype == dh.dtype == jnp.bfloat16
  want = vjp0(g)
  for a, b in zip((dx, dh), want):
    np.testing.assert_allclose(a.astype(jnp.float32), b, rtol=3e-2, atol=0.15)
  # Every matmul, forward and backward, takes bf16 operands (no float32 upcast).
  jaxpr = jax.make_jaxpr(lambda x, h: jax.grad(
      lambda x, h: jnp.sum(project_logits(x, h) * g), argnums=(0, 1))(x, h))(
          xb, hb)
  dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
  assert len(dots) == 3   # the forward and the two backward matmuls
  for e in dots:
    assert all(v.aval.dtype == jnp.bfloat16 for v in e.invars), e


def test_rmsnorm_formula():
  x = jax.random.normal(jax.random.key(0), (3, 16)) * 3
  n = RMSNorm(16, rngs=nnx.Rngs(0))
  n.scale[...] = jnp.linspace(0.5, 2, 16)
  want = x / jnp.sqrt(jnp.mean(x**2, -1, keepdims=True) + 1e-6) * n.scale[...]
  np.testing.assert_allclose(n(x), want, rtol=1e-5)


def test_attention_is_causal():
  attn = Attention(32, 4, 2, 8, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (1, 6, 32))
  pos = jnp.arange(6)[None]
  y1 = attn(x, pos)
  y2 = attn(x.at[:, 4:].set(7.0), pos)
  np.testing.assert_allclose(y1[:, :4], y2[:, :4], rtol=1e-5, atol=1e-6)
  assert float(jnp.abs(y1[:, 4:] - y2[:, 4:]).max()) > 1e-3


@pytest.mark.parametrize("residual,blocks", [
    ("prenorm", 0), ("hyper", 0), ("attnres", 0), ("mhar", 0), ("mhar", 2),
    ("attnres", 3), ("delta", 0)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_scheme_shapes_and_dtypes(residual, blocks, dtype):
  cfg = small(residual=residual, num_blocks=blocks, dtype=dtype)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  logits = nnx.jit(lambda m, t: m(t))(model, tokens())
  chex.assert_shape(logits, (2, 7, 61))
  chex.assert_type(logits, jnp.float32)
  chex.assert_tree_all_finite(logits)
  if residual in ("attnres", "mhar", "delta"):
    _, routing = model(tokens(), return_routing=True)
    assert len(routing) == 2 * cfg.num_layers + 1
    for w in routing:
      chex.assert_shape(w, (w.shape[0], 2, 7, cfg.heads_per_site))
      np.testing.assert_allclose(jnp.sum(w, 0), 1.0, rtol=1e-5)


def full_method_by_hand(model, toks):
  """Independent full AttnRes/MHAR forward: every raw sublayer output is a source."""
  cfg = model.cfg
  pos = jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape)
  emb = model.embedding[...]
  sources = [emb[toks]]
  for j, f in enumerate(model.sublayers()):
    r = model.routers[j]
    x = kernels.route(sources, r.query[...], r.norm_scale[...],
                      num_heads=cfg.heads_per_site)
    sources.append(f(x, pos))
  r = model.routers[-1]
  x = kernels.route(sources, r.query[...], r.norm_scale[...],
                    num_heads=cfg.heads_per_site)
  return jnp.einsum("btd,vd->btv", model.final_norm(x), emb)


@pytest.mark.parametrize("residual", ["attnres", "mhar"])
def test_one_sublayer_per_block_equals_full_method(residual):
  cfg = small(residual=residual, num_blocks=4)        # 2L = 4 sublayers
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  randomize_routers(model)
  want = full_method_by_hand(model, tokens())
  np.testing.assert_allclose(model(tokens()), want, rtol=1e-5, atol=1e-5)
  full = Transformer(small(residual=residual), rngs=nnx.Rngs(0))
  randomize_routers(full)
  np.testing.assert_allclose(full(tokens()), want, rtol=1e-5, atol=1e-5)


def test_block_sources_by_hand():
  """4 sublayers in 2 blocks: sites read s0, block sums and the partial sum."""
  model = Transformer(small(residual="mhar", num_blocks=2), rngs=nnx.Rngs(0))
  randomize_routers(model, seed=3)
  toks = tokens()
  pos = jnp.broadcast_to(jnp.arange(7), toks.shape)
  emb = model.embedding[...]
  s0 = emb[toks]
  f = model.sublayers()
  rt = lambda j, src: model.routers[j](src)
  s1 = f[0](rt(0, [s0]), pos)
  s2 = f[1](rt(1, [s0, s1]), pos)
  b1 = s1 + s2
  s3 = f[2](rt(2, [s0, b1]), pos)
  s4 = f[3](rt(3, [s0, b1, s3]), pos)
  x = rt(4, [s0, b1, s3 + s4])
  want = jnp.einsum("btd,vd->btv", model.final_norm(x), emb)
  np.testing.assert_allclose(model(toks), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("residual", ["delta", "hyper"])
def test_identity_at_init_equals_prenorm(residual):
  base = Transformer(small(residual="prenorm"), rngs=nnx.Rngs(0))
  other = Transformer(small(residual=residual), rngs=nnx.Rngs(0))
  # the shared parameters are drawn in the same order, so they are equal
  np.testing.assert_array_equal(base.embedding[...], other.embedding[...])
  tol = 1e-6 if residual == "delta" else 5e-3   # HC: 4x stream vs the norm's eps
  np.testing.assert_allclose(other(tokens()), base(tokens()), rtol=tol, atol=tol)


@pytest.mark.parametrize("heads", [1, 2, 4, 8, 16, 32])
def test_mhar_adds_no_parameters(heads):
  attnres = count_params(Transformer(small(residual="attnres"), rngs=nnx.Rngs(0)))
  mhar = count_params(Transformer(small(residual="mhar", routing_heads=heads),
                                  rngs=nnx.Rngs(0)))
  assert attnres == mhar


def load_preset(name):
  from mhar_jax.config import load_config_file
  return load_config_file(str(ROOT / "configs" / f"{name}.py"))


def abstract_count(cfg):
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  return count_params(model)


@pytest.mark.parametrize("name,billions", [("100m", None), ("350m", None),
                                           ("1b", 1.0795)])
def test_preset_parameter_counts(name, billions):
  from mhar_jax.config import model_config
  cfg = model_config(load_preset(name))
  assert cfg.vocab_size == 151_936
  n = abstract_count(cfg)
  d, L, f = cfg.d_model, cfg.num_layers, cfg.ffn_dim
  attn = d * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 2 * cfg.head_dim
  expected = (cfg.vocab_size * d + L * (attn + 3 * d * f + 2 * d) + d
              + (2 * L + 1) * 2 * d)
  assert n == expected
  if billions:
    assert abs(n / 1e9 - billions) / billions < 1e-3, n


@pytest.mark.parametrize("name", ["100m", "350m", "1b"])
def test_presets_recompute_lowest_sites(name):
  """The paper presets recompute the lowest three quarters of the sites'
  outputs, and stay valid with the schemes that have no routing sites (the
  baselines, picked on the command line); a scheme that cannot recompute them
  says which key to set."""
  from mhar_jax.config import model_config
  c = load_preset(name)
  assert model_config(c).recompute_site_outputs == 0.75
  for residual in ("prenorm", "hyper", "attnres", "mhar"):
    c.model.residual = residual
    assert model_config(c).residual == residual
  c.model.routing_backward = "site"
  with pytest.raises(ValueError,
                     match=r"model.recompute_site_outputs=0.75.*Set it to 0"):
    model_config(c)
  c.model.recompute_site_outputs = 0
  assert model_config(c).routing_backward == "site"


def test_config_validation_names_key_and_value():
  with pytest.raises(ValueError, match=r"model.routing_heads=3"):
    small(residual="mhar", routing_heads=3)
  with pytest.raises(ValueError, match=r"model.residual='resnet'"):
    small(residual="resnet")
  with pytest.raises(ValueError, match=r"model.num_blocks=9"):
    small(residual="mhar", num_blocks=9)
  with pytest.raises(ValueError, match=r"model.num_kv_heads=3"):
    small(num_kv_heads=3)
  with pytest.raises(ValueError, match=r"model.routingheads"):
    TransformerConfig.from_dict({"routingheads": 8})
  with pytest.raises(ValueError, match=r"model.routing_heads=5"):
    DepthRouter(32, 5)
  with pytest.raises(ValueError, match=r"model.num_kv_heads=3"):
    Attention(32, 4, 3, 8, rngs=nnx.Rngs(0))


class LinenDecoderWithRouter(nn.Module):
  """A Linen model that routes two of its own features with an NNX DepthRouter."""

  @nn.compact
  def __call__(self, x):
    a = nn.Dense(16, name="a")(x)
    b = nn.Dense(16, name="b")(x)
    return nnx.bridge.to_linen(DepthRouter, 16, num_heads=4, skip_rng=True,
                               name="router")([x, a, b])


def test_router_and_decoder_inside_linen():
  x = jax.random.normal(jax.random.key(0), (2, 3, 16))
  model = LinenDecoderWithRouter()
  params = nn.unbox(model.init(jax.random.key(1), x))["params"]
  assert params["router"]["query"].shape == (16,)
  params["router"]["query"] = jax.random.normal(jax.random.key(2), (16,))
  y = model.apply({"params": params}, x)
  a = x @ params["a"]["kernel"] + params["a"]["bias"]
  b = x @ params["b"]["kernel"] + params["b"]["bias"]
  want = kernels.route([x, a, b], params["router"]["query"],
                       params["router"]["norm_scale"], num_heads=4)
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)

  cfg = small(residual="mhar")
  decoder = nnx.bridge.to_linen(Transformer, cfg)
  dvars = decoder.init(jax.random.key(0), tokens())
  logits = decoder.apply(dvars, tokens())
  chex.assert_shape(logits, (2, 7, 61))
  n = sum(p.size for p in jax.tree.leaves(nn.unbox(dvars)["params"]))
  assert n == count_params(Transformer(cfg, rngs=nnx.Rngs(0)))
