"""routed_stack (source-major backward) against differentiating the per-site loop."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mhar_jax.kernels import reference, stack
from mhar_jax.kernels.stack import SublayerRMSNorm, routed_stack


def toy_sublayer(j, p, x, consts):
  """A sublayer that mixes channels and depends on j and on consts."""
  scale = consts["scale"] if consts is not None else 1.0
  return jnp.tanh(x @ p["w"] + p["b"]) * (1.0 + 0.1 * j) * scale


def loop(h, params, queries, gains, consts, num_heads, eps=1e-6):
  sources = [h]
  for j, p in enumerate(params):
    x = reference.route(sources, queries[j], gains[j], num_heads=num_heads,
                        eps=eps)
    sources.append(toy_sublayer(j, p, x, consts))
  return reference.route(sources, queries[-1], gains[-1], num_heads=num_heads,
                         eps=eps)


def block_loop(h, params, queries, gains, consts, num_heads, blocks,
               sublayer=toy_sublayer):
  """Block AttnRes / MHAR written out site by site (as layers.Transformer)."""
  done, partial = [h], None
  for j, p in enumerate(params):
    sources = done if partial is None else done + [partial]
    x = reference.route(sources, queries[j], gains[j], num_heads=num_heads)
    y = sublayer(j, p, x, consts)
    partial = y if partial is None else partial + y
    if j + 1 == len(params) or blocks[j + 1] != blocks[j]:
      done.append(partial)
      partial = None
  return reference.route(done, queries[-1], gains[-1], num_heads=num_heads)


def problem(n, d, shape=(3, 5), seed=0, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 5)
  h = jax.random.normal(ks[0], (*shape, d)).astype(dtype)
  params = tuple({"w": (jax.random.normal(k, (d, d)) / np.sqrt(d)).astype(dtype),
                  "b": (0.1 * jax.random.normal(jax.random.fold_in(k, 1), (d,))
                        ).astype(dtype)}
                 for k in jax.random.split(ks[1], n))
  queries = 0.7 * jax.random.normal(ks[2], (n + 1, d))
  gains = 1.0 + 0.3 * jax.random.normal(ks[3], (n + 1, d))
  consts = {"scale": jnp.asarray(1.3, dtype)}
  cot = jax.random.normal(ks[4], h.shape).astype(dtype)
  return h, params, queries, gains, consts, cot


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


@pytest.mark.parametrize("num_heads,n", [(1, 5), (2, 1), (4, 6), (8, 3)])
@pytest.mark.parametrize("site_group", [0, 2, 4])
def test_values_and_gradients_match_the_site_loop(num_heads, n, site_group):
  h, params, queries, gains, consts, cot = problem(n, 16)
  fused = functools.partial(routed_stack, apply=toy_sublayer,
                            num_heads=num_heads, site_group=site_group)

  def f_fused(h, params, queries, gains):
    return jnp.sum(fused(h, params, queries=queries, gains=gains,
                         consts=consts) * cot)

  def f_loop(h, params, queries, gains):
    return jnp.sum(loop(h, params, queries, gains, consts, num_heads) * cot)

  out = fused(h, params, queries=queries, gains=gains, consts=consts)
  want = loop(h, params, queries, gains, consts, num_heads)
  assert rel_err(out, want) < 1e-5
  g = jax.jit(jax.grad(f_fused, argnums=(0, 1, 2, 3)))(h, params, queries, gains)
  w = jax.jit(jax.grad(f_loop, argnums=(0, 1, 2, 3)))(h, params, queries, gains)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
    assert rel_err(a, b) < 2e-5, rel_err(a, b)
  # the routing is far from uniform, so the logit terms are exercised
  wts = reference.routing_weights([h, h * 2 + 1], queries[0], gains[0],
                                  num_heads=num_heads)
  assert float(jnp.abs(wts - 0.5).max()) > 0.05


@pytest.mark.parametrize("num_heads,blocks", [
    (4, (0, 0, 1, 1, 1, 2)),       # blocks of 2, 3, 1
    (1, (0, 0, 0, 0)),             # one block: every site reads [s_0, partial]
    (2, (0, 1, 1, 2, 2, 2, 3)),
    (8, (0, 1, 2))])               # one sublayer a block: the full method
@pytest.mark.parametrize("buffers,site_group", [(False, 0), (True, 0),
                                               (True, 2)])
def test_blocks_match_the_block_loop(num_heads, blocks, buffers, site_group):
  """Block AttnRes / MHAR through routed_stack: values and every gradient
  against autodiff of the site-by-site block loop, with the list and the
  whole-stack-buffer bookkeeping, site by site and two-phase by block."""
  from mhar_jax.kernels import stack
  n = len(blocks)
  h, params, queries, gains, consts, cot = problem(n, 16, seed=n)
  plan = stack._Plan(num_heads, 1e-6, "reference", blocks=blocks,
                     buffers=buffers, site_group=site_group)
  assert_stack_is_the_block_loop(plan, (toy_sublayer, None, None),
                                 toy_sublayer,
                                 h, params, queries, gains, consts, cot)


def assert_stack_is_the_block_loop(plan, fns, sublayer, h, params, queries,
                                   gains, consts, cot):
  """``stack._stack`` with ``fns`` against autodiff of ``block_loop`` with
  ``sublayer``: the value and every gradient."""
  from mhar_jax.kernels import stack

  def f_fused(h, params, queries, gains):
    return jnp.sum(stack._stack(h, params, queries, gains, consts, fns,
                                plan) * cot)

  def f_loop(h, params, queries, gains):
    return jnp.sum(block_loop(h, params, queries, gains, consts,
                              plan.num_heads, plan.blocks, sublayer) * cot)

  args = (h, params, queries, gains)
  assert rel_err(stack._stack(*args, consts, fns, plan),
                 block_loop(*args, consts, plan.num_heads, plan.blocks,
                            sublayer)) < 1e-5
  g = jax.jit(jax.grad(f_fused, argnums=(0, 1, 2, 3)))(*args)
  w = jax.jit(jax.grad(f_loop, argnums=(0, 1, 2, 3)))(*args)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g)[0],
                          jax.tree.leaves(w)):
    assert rel_err(a, b) < 2e-5, (jax.tree_util.keystr(path), rel_err(a, b))


def toy_body(j, p, x, consts):
  """toy_sublayer before an output projection ``wo`` (toy_project)."""
  return toy_sublayer(j, p, x, consts)


def toy_project(j, p, u):
  return u @ p["wo"] if j % 3 else u       # every third sublayer: identity


def composed(j, p, x, consts):
  return toy_project(j, p, toy_body(j, p, x, consts))


@pytest.mark.parametrize("blocks,site_group,buffers", [
    (None, 0, False), (None, 0, True), (None, 2, True), (None, 4, False),
    ((0, 0, 1, 1, 1, 2), 0, True), ((0, 0, 1, 1, 1, 2), 0, False),
    ((0, 0, 0, 1, 1, 1), 2, True)])
def test_projected_sources_match_the_loop(blocks, site_group, buffers):
  """With ``project`` the backward recomputes the sources (full method) or
  the block and partial sums (blocks) from the projections' inputs: values
  and every gradient (the projections' weights too) against autodiff of the
  loop of whole sublayers."""
  from mhar_jax.kernels import stack
  n, num_heads = 6, 4
  h, params, queries, gains, consts, cot = problem(n, 16, seed=11)
  params = tuple(dict(p, wo=jax.random.normal(jax.random.key(j), (16, 16)) / 4)
                 for j, p in enumerate(params))
  blk = tuple(range(n)) if blocks is None else blocks
  plan = stack._Plan(num_heads, 1e-6, "reference", blocks=blk,
                     buffers=buffers, site_group=site_group)
  assert_stack_is_the_block_loop(plan, (toy_body, toy_project, None), composed,
                                 h, params, queries, gains, consts, cot)
  # the sources (full) or the block and partial sums are not saved
  saved = stack._forward(h, params, queries, gains, consts,
                         (toy_body, toy_project, None), plan, save=True)[1]
  assert len(saved[0]) == 1 and len(saved[-1]) == n
  assert all(p is None for p in saved[2])


def test_projected_sources_are_not_kept():
  """XLA's plan of the backward is smaller with the sources recomputed: the
  recomputation is not merged with the forward's product (which would keep
  every source alive after all). CPU: 4.7 of the 8 sources' bytes less."""
  from mhar_jax.kernels import stack
  n, d, tok = 8, 64, 8192
  ks = jax.random.split(jax.random.key(0), 2 * n + 2)
  params = tuple({"w": jax.random.normal(ks[2 * j], (d, d)) / 8,
                  "wo": jax.random.normal(ks[2 * j + 1], (d, d)) / 8}
                 for j in range(n))
  h = jax.random.normal(ks[-1], (tok, d))
  queries, gains = jax.random.normal(ks[-2], (n + 1, d)), jnp.ones((n + 1, d))
  body = lambda j, p, x, c: jnp.tanh(x @ p["w"])            # noqa: E731
  project = lambda j, p, u: u @ p["wo"]                     # noqa: E731
  whole = lambda j, p, x, c: project(j, p, body(j, p, x, c))  # noqa: E731
  temp = {}
  for name, fns in (("kept", (whole, None, None)),
                    ("recomputed", (body, project, None))):
    plan = stack._Plan(4, 1e-6, "reference", buffers=True)
    f = lambda h, p: jnp.sum(stack._stack(h, p, queries, gains, None, fns,  # noqa: E731
                                          plan) ** 2)
    compiled = jax.jit(jax.grad(f, argnums=(0, 1))).lower(h, params).compile()
    temp[name] = compiled.memory_analysis().temp_size_in_bytes
  assert temp["kept"] - temp["recomputed"] >= 3 * tok * d * 4, temp


def toy_norm(j, p, x):
  """An RMSNorm with gain ``p["g"]`` (the sublayers' input norm)."""
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p["g"]


def toy_scale(j, p):
  return p["g"]


# the same norm, as the stack takes it
TOY_NORM = SublayerRMSNorm(toy_scale, 1e-6)


def normed(j, p, x, consts):
  return toy_sublayer(j, p, toy_norm(j, p, x), consts)


@pytest.mark.parametrize("blocks,site_group,buffers,below", [
    (None, 0, False, None), (None, 0, True, None), (None, 2, True, None),
    (None, 4, False, None), (None, 3, True, None),
    ((0, 0, 1, 1, 1, 2), 0, True, None), ((0, 0, 1, 1, 1, 2), 0, False, None),
    ((0, 0, 0, 1, 1, 1), 2, True, None),
    # the lowest sites only: groups (0, 2), (2, 5), (5, 7) cut at site 3
    (None, 3, True, 3), (None, 3, False, 4), (None, 0, True, 2),
    ((0, 0, 1, 1, 1, 2), 0, True, 3), ((0, 0, 0, 1, 1, 1), 2, True, 4),
    (None, 3, True, 0)])
def test_recomputed_site_outputs_match_the_loop(blocks, site_group, buffers,
                                                below):
  """With ``norm`` the forward keeps no site's output below ``below`` (all
  but the last: ``None``), and the backward recomputes each from the
  sources (full method: a group of sites at once, each over its own first
  sources, the group cut at ``below``; blocks: site by site) before the
  norm's gradient: values and every gradient (the norms' gains too)
  against autodiff of the loop of whole sublayers."""
  from mhar_jax.kernels import stack
  n, num_heads = 6, 4
  h, params, queries, gains, consts, cot = problem(n, 16, seed=5)
  params = tuple(dict(p, g=1.0 + 0.3 * jax.random.normal(
      jax.random.key(j), (16,))) for j, p in enumerate(params))
  blk = tuple(range(n)) if blocks is None else blocks
  plan = stack._Plan(num_heads, 1e-6, "reference", blocks=blk,
                     buffers=buffers, site_group=site_group,
                     recompute_below=below)
  assert_stack_is_the_block_loop(plan, (toy_sublayer, None, TOY_NORM), normed,
                                 h, params, queries, gains, consts, cot)
  xs = stack._forward(h, params, queries, gains, consts,
                      (toy_sublayer, None, TOY_NORM), plan, save=True)[1][4]
  k = n if below is None else below
  assert [x is None for x in xs] == [j < k for j in range(n + 1)]


def test_recomputed_site_outputs_are_not_kept():
  """XLA's plan of the backward is smaller with the sites' outputs
  recomputed: the recomputation is neither merged with the forward's
  routing nor hoisted into the forward (CPU, the whole-stack buffer with
  groups of 4 sites). Recomputing the lowest 6 of 12 saves part of that;
  recomputing none (``norm`` given, ``recompute_below=0``) keeps every
  output, as without ``norm``."""
  from mhar_jax.kernels import stack
  n, d, tok = 12, 64, 8192
  ks = jax.random.split(jax.random.key(0), n + 2)
  params = tuple({"w": jax.random.normal(ks[j], (d, d)) / 8,
                  "g": jnp.ones((d,))} for j in range(n))
  h = jax.random.normal(ks[-1], (tok, d))
  queries, gains = jax.random.normal(ks[-2], (n + 1, d)), jnp.ones((n + 1, d))
  body = lambda j, p, x, c: jnp.tanh(x @ p["w"])              # noqa: E731
  whole = lambda j, p, x, c: body(j, p, toy_norm(j, p, x), c)  # noqa: E731
  temp = {}
  for name, fns, below in (("kept", (whole, None, None), None),
                           ("recomputed", (body, None, TOY_NORM), None),
                           ("lower half", (body, None, TOY_NORM), n // 2),
                           ("none", (body, None, TOY_NORM), 0)):
    plan = stack._Plan(4, 1e-6, "reference", buffers=True, site_group=4,
                       recompute_below=below)
    f = lambda h, p: jnp.sum(stack._stack(h, p, queries, gains, None, fns,  # noqa: E731
                                          plan) ** 2)
    compiled = jax.jit(jax.grad(f, argnums=(0, 1))).lower(h, params).compile()
    temp[name] = compiled.memory_analysis().temp_size_in_bytes
  array = tok * d * 4
  assert temp["kept"] - temp["recomputed"] >= 4 * array, temp
  assert temp["kept"] - temp["lower half"] >= 3 * array, temp
  assert temp["lower half"] >= temp["recomputed"], temp
  assert abs(temp["none"] - temp["kept"]) <= array, temp


def test_norm_must_be_the_stacks_rms_norm():
  h, params, queries, gains, consts, _ = problem(2, 8)
  with pytest.raises(ValueError, match="norm=.*SublayerRMSNorm"):
    routed_stack(h, params, toy_sublayer, queries, gains, consts,
                 num_heads=2, norm=toy_norm)


def test_norm_and_project_are_exclusive():
  h, params, queries, gains, consts, _ = problem(2, 8)
  with pytest.raises(ValueError, match="norm.*project"):
    routed_stack(h, params, toy_sublayer, queries, gains, consts,
                 num_heads=2, project=lambda j, p, u: u, norm=TOY_NORM)
  for kw in (dict(recompute_below=1), dict(norm=TOY_NORM, recompute_below=3),
             dict(norm=TOY_NORM, recompute_below=-1)):
    with pytest.raises(ValueError, match="recompute_below="):
      routed_stack(h, params, toy_sublayer, queries, gains, consts,
                   num_heads=2, **kw)


def test_site_groups():
  from mhar_jax.kernels import stack
  full = stack._Plan(2, 1e-6, "reference", site_group=3)
  # 2 sites, then 3 from site 2 (sites 2 and 5 read 3 and 6 sources)
  assert full.site_groups(6) == [(0, 2), (2, 5), (5, 7)]
  assert full.site_groups(1) == [(0, 2)]
  assert stack._Plan(2, 1e-6, "reference").site_groups(2) == [
      (0, 1), (1, 2), (2, 3)]
  blocked = stack._Plan(2, 1e-6, "reference", blocks=(0, 0, 1, 1, 1),
                        site_group=2)
  assert blocked.site_groups(5) == [(0, 2), (2, 5), (5, 6)]


def test_two_phase_bfloat16_is_site_by_site_up_to_rounding():
  """The first phase's result is stored in bf16 before the later sources are
  added: within bf16 rounding of routing every site on its own."""
  n = 7
  h, params, queries, gains, consts, _ = problem(n, 32, dtype=jnp.bfloat16)
  kw = dict(apply=toy_sublayer, queries=queries, gains=gains, consts=consts,
            num_heads=4)
  one = routed_stack(h, params, **kw)
  for g in (3, 8):
    grouped = routed_stack(h, params, site_group=g, **kw)
    assert grouped.dtype == jnp.bfloat16
    assert rel_err(grouped.astype(jnp.float32), one.astype(jnp.float32)) < 2e-2


def test_bad_blocks_are_named():
  h, params, queries, gains, consts, _ = problem(3, 8)
  for blocks in ((0, 0), (1, 1, 2), (0, 2, 2), (0, 1, 0)):
    with pytest.raises(ValueError, match=r"blocks=.*one block index per"):
      routed_stack(h, params, toy_sublayer, queries, gains, consts,
                   num_heads=2, blocks=blocks)


def test_buffer_backward_equals_list_backward():
  """The whole-stack-buffer bookkeeping (what the Triton kernel reads), run
  with the jnp per-source function, gives the list path's gradients."""
  from mhar_jax.kernels import stack
  h, params, queries, gains, consts, cot = problem(5, 16)
  out = {}
  for buffers in (False, True):
    plan = stack._Plan(4, 1e-6, "reference", buffers=buffers)
    out[buffers] = jax.jit(jax.grad(lambda h, p, q, g: jnp.sum(stack._stack(
        h, p, q, g, consts, (toy_sublayer, None, None), plan) * cot), argnums=(0, 1, 2, 3)))(
            h, params, queries, gains)
  for a, b in zip(jax.tree.leaves(out[True]), jax.tree.leaves(out[False])):
    assert rel_err(a, b) < 1e-5, rel_err(a, b)


def test_bfloat16_gradients_match_float32():
  h, params, queries, gains, consts, cot = problem(4, 32)
  cast = lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t)

  def f(h, params, queries, gains, consts, cot):
    out = routed_stack(h, params, toy_sublayer, queries, gains, consts,
                       num_heads=4)
    return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32))

  g32 = jax.grad(f, argnums=(0, 1, 2, 3))(h, params, queries, gains, consts,
                                          cot)
  g16 = jax.grad(f, argnums=(0, 1, 2, 3))(cast(h), cast(params), queries,
                                          gains, cast(consts), cast(cot))
  for a, b in zip(jax.tree.leaves(g16), jax.tree.leaves(g32)):
    assert rel_err(a, b) < 5e-2, rel_err(a, b)


def test_remat_sublayers_and_jit():
  h, params, queries, gains, consts, cot = problem(3, 8)
  remat = jax.checkpoint(toy_sublayer, static_argnums=(0,))

  def f(apply):
    return jax.jit(jax.grad(lambda h, p: jnp.sum(routed_stack(
        h, p, apply, queries, gains, consts, num_heads=2) * cot),
        argnums=(0, 1)))(h, params)

  for a, b in zip(jax.tree.leaves(f(remat)), jax.tree.leaves(f(toy_sublayer))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bad_shapes_are_named():
  h, params, queries, gains, consts, _ = problem(3, 8)
  with pytest.raises(ValueError, match=r"must\s+both be \(4, 8\)"):
    routed_stack(h, params, toy_sublayer, queries[:3], gains, consts,
                 num_heads=2)
  with pytest.raises(ValueError, match="num_heads=3"):
    routed_stack(h, params, toy_sublayer, queries, gains, consts, num_heads=3)


# -- the decoder with routing_backward="source" ------------------------------------

def decoder_grads(residual, routing_backward, remat=False, heads=4, seed=0,
                  num_blocks=0, site_group=0, recompute="none"):
  from flax import nnx

  from mhar_jax.layers import Transformer, TransformerConfig
  from helpers import recompute_kwargs
  cfg = TransformerConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2,
                          num_kv_heads=1, head_dim=16, ffn_dim=48,
                          max_seq_len=16, residual=residual, routing_heads=heads,
                          dtype="float32", routing_backward=routing_backward,
                          remat=remat, num_blocks=num_blocks,
                          routing_site_group=site_group,
                          **recompute_kwargs(recompute))
  from mhar_jax import training
  gdef = training.graphdef(cfg)
  params = nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(seed)),
                                      nnx.Param))
  # non-zero queries so the routing is not a uniform mean
  ks = iter(jax.random.split(jax.random.key(1), 100))
  params["routers"] = {k: {"query": 0.5 * jax.random.normal(next(ks), v["query"].shape),
                           "norm_scale": v["norm_scale"]}
                       for k, v in params["routers"].items()}
  toks = jax.random.randint(jax.random.key(2), (2, 16), 0, 64)

  def loss(p):
    logits = nnx.merge(gdef, p)(toks)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits

  (_, logits), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return logits, g


@pytest.mark.parametrize(
    "residual,heads,remat,num_blocks,site_group,recompute", [
        ("mhar", 4, False, 0, 0, "none"), ("attnres", 1, False, 0, 0, "none"),
        ("mhar", 2, True, 0, 0, "none"), ("mhar", 4, False, 2, 0, "none"),
        ("attnres", 1, True, 3, 0, "none"),
        ("mhar", 4, False, 0, 3, "none"),         # two-phase groups
        ("mhar", 2, True, 2, 2, "none"),
        ("mhar", 4, False, 0, 0, "attention"),    # sources recomputed
        ("attnres", 1, True, 0, 3, "all"),
        ("mhar", 4, False, 2, 0, "all"),          # block sums recomputed
        ("mhar", 2, True, 2, 2, "attention"),
        ("mhar", 4, False, 0, 3, "outputs"),      # sites' outputs recomputed
        ("attnres", 1, True, 0, 0, "outputs"),
        ("mhar", 2, False, 2, 0, "outputs"),
        ("mhar", 4, False, 0, 3, "outputs=0.75"),  # the lowest 3 of 4 sites
        ("mhar", 2, False, 2, 0, "outputs=0.5")])
def test_decoder_source_backward_equals_site_backward(residual, heads, remat,
                                                      num_blocks, site_group,
                                                      recompute):
  la, ga = decoder_grads(residual, "source", remat, heads,
                         num_blocks=num_blocks, site_group=site_group,
                         recompute=recompute)
  lb, gb = decoder_grads(residual, "site", remat, heads, num_blocks=num_blocks)
  assert rel_err(la, lb) < 1e-5
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ga)[0],
                          jax.tree.leaves(gb)):
    assert rel_err(a, b) < 2e-5, (jax.tree_util.keystr(path), rel_err(a, b))
  assert np.abs(np.asarray(ga["routers"][1]["query"])).max() > 1e-4


def test_source_backward_is_for_attnres_and_mhar():
  from mhar_jax.layers import TransformerConfig
  for residual in ("prenorm", "hyper", "delta"):
    with pytest.raises(ValueError, match="model.routing_backward='source'"):
      TransformerConfig(residual=residual, num_layers=2,
                        routing_backward="source")
  # full and block: "source" by default, "site" when asked for
  assert TransformerConfig(residual="mhar", num_layers=2,
                           num_blocks=2).source_major_backward
  assert not TransformerConfig(residual="mhar", num_layers=2, num_blocks=2,
                               routing_backward="site").source_major_backward
  assert TransformerConfig(residual="mhar", num_layers=2).source_major_backward
  with pytest.raises(ValueError, match="model.routing_backward='sideways'"):
    TransformerConfig(routing_backward="sideways")
  # site groups: only for the source-major stack, a non-negative integer
  with pytest.raises(ValueError, match="model.routing_site_group=4"):
    TransformerConfig(residual="prenorm", num_layers=2, routing_site_group=4)
  # recomputed sources: the source-major stack only (full or blocks)
  assert TransformerConfig(residual="mhar", num_layers=2, num_blocks=2,
                           recompute_sources="all").recompute_sources == "all"
  for kw in (dict(routing_backward="site"), dict(residual="prenorm")):
    with pytest.raises(ValueError, match="model.recompute_sources='all'"):
      TransformerConfig(**{"residual": "mhar", "num_layers": 2,
                           "recompute_sources": "all", **kw})
  with pytest.raises(ValueError, match="model.recompute_sources='mlp'"):
    TransformerConfig(residual="mhar", num_layers=2, recompute_sources="mlp")
  # recomputed sites' outputs: the source-major stack, the sources kept;
  # a stack without routing sites has nothing to recompute
  for kw, fix in ((dict(routing_backward="site"), "Set it to 0"),
                  (dict(residual="delta"), "Set it to 0"),
                  (dict(recompute_sources="attention"),
                   "recompute_site_outputs=0 or")):
    with pytest.raises(ValueError,
                       match=f"model.recompute_site_outputs=True.*{fix}"):
      TransformerConfig(**{"residual": "mhar", "num_layers": 2,
                           "recompute_site_outputs": True, **kw})
  for residual in ("prenorm", "hyper"):
    TransformerConfig(residual=residual, num_layers=2,
                      recompute_site_outputs=0.5)
  for share in (-0.5, 1.5, "half"):
    with pytest.raises(ValueError, match="model.recompute_site_outputs="):
      TransformerConfig(residual="mhar", num_layers=2,
                        recompute_site_outputs=share)
  with pytest.raises(ValueError, match="model.routing_site_group=4"):
    TransformerConfig(residual="mhar", num_layers=2, routing_site_group=4,
                      routing_backward="site")
  with pytest.raises(ValueError, match="model.routing_site_group=-1"):
    TransformerConfig(residual="mhar", num_layers=2, routing_site_group=-1)
  TransformerConfig(residual="mhar", num_layers=2, routing_site_group=4)


@pytest.mark.parametrize("layer,most,want", [
    ("attention", 3, 3), ("attention", 2, 2), ("swiglu", 3, 2),
    ("tanh", 3, 1), ("attention", 1, 1)])
def test_cotangent_terms_sum_to_the_vjp(layer, most, want):
  """``stack._cotangent_terms``: a sublayer's input cotangent as the terms
  autodiff adds (attention's Q, K, V products; SwiGLU's gate and up; one
  use, or elementwise operations only, one term: ``tanh``'s backward adds
  two elementwise terms), at most ``most`` of them, summing to the VJP's; the
  other outputs are the VJP's. Under jit, as the stack's backward runs."""
  from flax import nnx
  from mhar_jax.layers.basic import Attention, SwiGLU
  d = 32
  rngs = nnx.Rngs(0)
  if layer == "attention":
    mod = Attention(d, 4, 2, 8, rngs=rngs)
    f = lambda p, x: mod(x, jnp.arange(x.shape[1])[None]) * p  # noqa: E731
  elif layer == "swiglu":
    mod = SwiGLU(d, 48, rngs=rngs)
    f = lambda p, x: mod(x) * p  # noqa: E731
  else:
    f = lambda p, x: jnp.tanh(x) * p  # noqa: E731
  x = jax.random.normal(jax.random.key(1), (2, 5, d))
  p = jnp.float32(1.3)
  dy = jax.random.normal(jax.random.key(2), (2, 5, d))

  @jax.jit
  def run(p, x, dy):
    _, vjp = jax.vjp(f, p, x)
    (dp, _), terms = stack._cotangent_terms(vjp, dy, most)
    return vjp(dy), dp, terms

  (dp_ref, dx_ref), dp, terms = run(p, x, dy)
  assert len(terms) == want
  np.testing.assert_allclose(sum(terms), dx_ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dp, dp_ref, rtol=1e-6)
