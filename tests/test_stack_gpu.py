"""GPU tests: routed_stack with the Triton kernels against its jnp reference.

Skipped unless JAX's default backend is a GPU and jax_triton imports (run on
the device with ``JAX_PLATFORMS=cuda``). Values and gradients (embedding,
every sublayer parameter, queries, gains) on fresh random inputs, float32 to
1e-5 relative (to the largest element of the reference); bfloat16 against the
float32 computation on the same inputs, to 1e-2 or 1.5x the bfloat16
reference's worst error, whichever is larger (rounding compounds in deep stacks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

if jax.default_backend() != "gpu":
  pytest.skip("Triton kernels need a CUDA GPU", allow_module_level=True)
pytest.importorskip("jax_triton")

from mhar_jax.kernels.stack import SublayerRMSNorm, routed_stack

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def sublayer(j, p, x, consts):
  y = jnp.tanh(x.astype(jnp.float32) @ p["w"].astype(jnp.float32) + p["b"])
  return (y * (1.0 + 0.1 * j) * consts).astype(x.dtype)


def rel(a, b):
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
  assert np.isfinite(a).all()
  return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def _grads(h, params, queries, gains, cot, impl, heads, blocks, site_group,
           apply=sublayer):
  def f(h, params, queries, gains):
    out = routed_stack(h, params, apply, queries, gains,
                       jnp.asarray(1.3, jnp.float32), num_heads=heads,
                       impl=impl, blocks=blocks, site_group=site_group)
    return jnp.sum(out.astype(jnp.float32) * cot), out
  return jax.grad(f, argnums=(0, 1, 2, 3), has_aux=True)(h, params, queries,
                                                          gains)


# The reference's compile is shared by every test with its shapes and
# sublayer (at 40 sites it takes about a minute; a bf16 case's fp32 run is
# the fp32 case's); the kernels' is not: they read tunings (e.g.
# ``ffi_launch``) that tests change at trace time.
_reference_grads = jax.jit(_grads, static_argnums=(5, 6, 7, 8, 9))


def grads(impl, h, params, queries, gains, cot, heads, blocks=None,
          site_group=0, apply=sublayer):
  """Gradients of ``sum(routed_stack(h, params, apply, ...) * cot)`` by
  ``impl`` (jitted)."""
  if impl == "reference":
    return _reference_grads(h, params, queries, gains, cot, impl, heads,
                            blocks, site_group, apply)
  # a new function each call: traced afresh under the tunings of the moment
  return jax.jit(lambda *a: _grads(*a, impl, heads, blocks, site_group,
                                   apply))(h, params, queries, gains, cot)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("lead,d,heads,n,blocks,site_group", [
    ((2, 37), 64, 4, 5, None, 0), ((3, 160), 1280, 8, 4, None, 0),
    ((1, 19), 256, 1, 3, None, 0), ((2, 64), 512, 16, 6, None, 0),
    ((2, 37), 64, 4, 5, (0, 0, 1, 1, 1), 0),
    ((3, 160), 1280, 8, 6, (0, 0, 0, 1, 1, 2), 0),
    # two-phase site groups (Triton vs the jnp site-by-site reference)
    ((3, 160), 1280, 8, 20, None, 8), ((2, 37), 64, 4, 5, None, 2),
    ((3, 160), 1280, 8, 6, (0, 0, 0, 1, 1, 2), 2),
    # groups of >= 8 sites on tensor cores (triton_stack.sites)
    ((2, 37), 64, 4, 18, None, 16), ((3, 160), 1280, 8, 17, None, 16),
    # ... and the backward's groups of sources (sources [9, 25) from 25..40)
    ((2, 37), 64, 4, 40, None, 16)])
def test_triton_stack_matches_reference(dtype, lead, d, heads, n, blocks,
                                        site_group, ratio=1.5,
                                        floor=TOL[jnp.bfloat16]):
  ks = jax.random.split(jax.random.key(d + n), 6)
  h = (jax.random.normal(ks[0], (*lead, d)) * 2 + 0.5).astype(dtype)
  params = tuple({"w": jax.random.normal(k, (d, d)) / np.sqrt(d),
                  "b": 0.1 * jax.random.normal(jax.random.fold_in(k, 1), (d,))}
                 for k in jax.random.split(ks[1], n))
  queries = 0.5 * jax.random.normal(ks[2], (n + 1, d)) / np.sqrt(d / heads)
  gains = 1 + 0.3 * jax.random.normal(ks[3], (n + 1, d))
  cot = jax.random.normal(ks[4], lead + (d,))
  got = grads("triton", h, params, queries, gains, cot, heads, blocks,
              site_group)
  want = grads("reference", h, params, queries, gains, cot, heads, blocks)
  assert_matches(dtype, got, want, lambda: grads(
      "reference", h.astype(jnp.float32), params, queries, gains, cot, heads,
      blocks), ratio, floor)


def assert_matches(dtype, got, want, exact, ratio=1.5,
                   floor=TOL[jnp.bfloat16]):
  """Every leaf of the kernels' ``got`` against the reference's ``want``:
  float32 within 1e-5. bf16: both paths round at every sublayer,
  differently, and in a deep stack the rounding compounds (at n = 40 the
  bf16 reference is up to 1.4% off, and which leaf is worst differs between
  the paths). Both are measured against the fp32 computation on the same
  (bf16-valued) inputs, ``exact()``: every leaf of the kernel's within
  ``floor`` or ``ratio`` x the bf16 reference's worst leaf, whichever is
  larger (a wrong element is O(1))."""
  if dtype == jnp.float32:
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert rel(a, b) <= TOL[dtype], rel(a, b)
    return
  exact = exact()
  ref_err = max(rel(b, c) for b, c in zip(jax.tree.leaves(want),
                                          jax.tree.leaves(exact)))
  errs = [rel(a, c) for a, c in zip(jax.tree.leaves(got),
                                    jax.tree.leaves(exact))]
  bad = [(k, e) for k, e in enumerate(errs)
         if e > max(floor, ratio * ref_err)]
  assert not bad, f"(leaf, error) over {ratio}x {ref_err:.2e}: {bad}"
  print(f"bf16: worst leaf {max(errs):.2e}, bf16 reference's {ref_err:.2e}")


def test_triton_stack_split_weights_off(monkeypatch):
  """bf16 with ``SITES_TUNING["split_weights"]`` off: the tensor-core groups'
  softmax weights go into the bf16 product as one bf16 term (as
  FlashAttention's), a rounding the reference does not make. ``lead9`` of the
  test above (18 sites, D = 64, groups of 16) put one leaf at 1.66x-2.02x the
  bf16 reference's worst error this way (1.41x with two terms, the default;
  RESULTS.md sessions 27-28): within 2.5x."""
  from mhar_jax.kernels import triton_stack
  monkeypatch.setitem(triton_stack.SITES_TUNING, "split_weights", False)
  test_triton_stack_matches_reference(jnp.bfloat16, (2, 37), 64, 4, 18, None,
                                      16, ratio=2.5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("lead,d,heads,n,blocks,site_group", [
    ((3, 160), 1280, 8, 20, None, 0), ((2, 37), 64, 4, 5, (0, 0, 1, 1, 1), 0),
    ((3, 160), 1280, 8, 20, None, 8)])
def test_triton_stack_kernel_inverse_rms(monkeypatch, dtype, lead, d, heads,
                                         n, blocks, site_group):
  """The stack with the forward kernel computing each source's inverse RMS
  itself (``fwd_given_r`` off; on by default)."""
  from mhar_jax.kernels import triton_route
  monkeypatch.setitem(triton_route.TUNING, "fwd_given_r", False)
  test_triton_stack_matches_reference(dtype, lead, d, heads, n, blocks,
                                      site_group)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("lead,d,heads,n,blocks,site_group", [
    ((3, 160), 1280, 8, 17, None, 16), ((2, 37), 64, 4, 40, None, 16),
    ((3, 160), 1280, 8, 6, (0, 0, 0, 1, 1, 2), 2)])
def test_triton_stack_ffi_launch(monkeypatch, dtype, lead, d, heads, n,
                                 blocks, site_group):
  """Every kernel launched through jaxlib's typed-FFI Triton call
  (``ffi_launch``): the program calls only that target, and the stack
  matches the reference."""
  from mhar_jax.kernels import triton_route
  monkeypatch.setitem(triton_route.TUNING, "ffi_launch", True)
  x = jnp.zeros((*lead, d), dtype)
  hlo = jax.jit(jax.grad(lambda x: jnp.sum(routed_stack(
      x, ({"w": jnp.eye(d), "b": jnp.zeros(d)},) * 2, sublayer,
      jnp.ones((3, d)), jnp.ones((3, d)), jnp.asarray(1.0), num_heads=heads,
      impl="triton").astype(jnp.float32)))).lower(x).as_text()
  assert "triton_kernel_call_ffi" in hlo
  assert "@triton_kernel_call(" not in hlo
  test_triton_stack_matches_reference(dtype, lead, d, heads, n, blocks,
                                      site_group)


@pytest.mark.parametrize("num_blocks,num_layers,recompute", [
    (0, 3, "none"), (2, 3, "none"), (0, 13, "none"), (0, 13, "attention"),
    (0, 13, "all"), (0, 24, "all"), (3, 13, "all"), (0, 13, "outputs"),
    (3, 13, "outputs"), (0, 13, "outputs=0.5")])
def test_decoder_source_backward_on_gpu(num_blocks, num_layers, recompute):
  """The decoder's default source-major stack (Triton; 13 layers: 27 sites,
  so the default groups of 16 route on tensor cores forward, sites 0-14 and
  15-26, and backward, sources 0-10; with the attention sublayers' sources or
  all of them recomputed, each group's cotangents in a buffer of its own; 24
  layers: sources 1-16 and 0 take their share of two and three such
  buffers; 3 blocks: block and partial sums recomputed, each block's
  cotangents a buffer apart; ``outputs``: the sites' outputs recomputed,
  ``recompute_site_outputs``; ``=0.5``: sites 0-12, the group of sites
  0-14 cut at 13) against the jnp site-by-site one."""
  from flax import nnx

  from mhar_jax import training
  from mhar_jax.layers import Transformer, TransformerConfig
  kw = dict(vocab_size=256, d_model=128, num_layers=num_layers, num_heads=4,
            num_kv_heads=2, head_dim=32, ffn_dim=256, max_seq_len=64,
            residual="mhar", routing_heads=8, dtype="float32",
            attention_impl="xla", num_blocks=num_blocks)
  toks = jax.random.randint(jax.random.key(0), (2, 64), 0, 256)
  from helpers import recompute_kwargs
  out = {}
  for name, extra in (("site", dict(routing_backward="site",
                                     routing_impl="reference")),
                      ("source", dict(
                          routing_backward="source", routing_impl="triton",
                          **recompute_kwargs(recompute)))):
    cfg = TransformerConfig(**kw, **extra)
    gdef = training.graphdef(cfg)
    params = nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)),
                                        nnx.Param))
    params["routers"] = {k: {"query": 0.3 * jax.random.normal(
        jax.random.key(int(k) + 1), v["query"].shape),
        "norm_scale": v["norm_scale"]} for k, v in params["routers"].items()}
    loss = lambda p: jnp.mean(jax.nn.log_softmax(nnx.merge(gdef, p)(toks))[..., 0])
    out[name] = jax.jit(jax.value_and_grad(loss))(params)
  assert rel(out["source"][0], out["site"][0]) <= 1e-5
  for a, b in zip(jax.tree.leaves(out["source"][1]),
                  jax.tree.leaves(out["site"][1])):
    assert rel(a, b) <= 1e-4


def norm(j, p, x):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
  return (y * p["g"]).astype(x.dtype)


def gain(j, p):
  return p["g"]


def normed_sublayer(j, p, x, consts):
  return sublayer(j, p, norm(j, p, x), consts)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("d,heads,n_tok", [(1280, 8, 1000), (512, 8, 4099),
                                           (1024, 16, 77), (64, 4, 1000),
                                           (48, 1, 5)])
@pytest.mark.parametrize("x_row,terms", [(None, 1), (2, 1), (None, 3),
                                         (2, 2)])
def test_norm_grad_kernel_against_autodiff(dtype, d, heads, n_tok, x_row,
                                           terms):
  """``norm_grad_local`` (a sublayer RMSNorm's backward into a buffer row)
  against the VJP of ``reference.rms_norm`` in float32 at the same inputs:
  ``dx`` (its row NaN before: an unwritten element fails; the other rows
  kept bit for bit), ``<dx, x>`` per head (to the size of its terms, which
  cancel), the gain's gradient; outputs poisoned first. ``x_row``: the
  input read in place as that row of ``[3, N, D]`` (a recomputed group's
  outputs). ``terms``: ``dy`` given as that many arrays (the products
  reading the sublayer's input), which the kernel adds."""
  from mhar_jax.kernels import reference, stack, triton_route, triton_stack
  ks = jax.random.split(jax.random.key(d + n_tok), 4 + terms)
  x = (jax.random.normal(ks[0], (n_tok, d)) * 1.7 + 0.2).astype(dtype)
  dys = [jax.random.normal(k, (n_tok, d)).astype(dtype) for k in ks[4:]]
  scale = 1 + 0.3 * jax.random.normal(ks[2], (d,))
  buf = jax.random.normal(ks[3], (3, n_tok, d)).astype(dtype)
  buf = buf.at[1].set(jnp.nan)
  xs = x if x_row is None else jax.random.normal(
      ks[0], (3, n_tok, d)).astype(dtype).at[x_row].set(x)
  with triton_route.poison_outputs():
    out, xd, dscale = jax.jit(
        lambda *a: triton_stack.norm_grad_local(*a[:3], 1e-6, heads, a[3], 1,
                                                x_row))(xs, scale, dys, buf)
  x32 = x.astype(jnp.float32)
  dy32 = sum(t.astype(jnp.float32) for t in dys)
  with jax.default_matmul_precision("highest"):
    _, vjp = jax.vjp(lambda x, s: reference.rms_norm(x, s, 1e-6), x32, scale)
    dx, want_dscale = vjp(dy32)
    want_xd = stack.dot_heads(dx, x32, heads)
    size_xd = stack.dot_heads(jnp.abs(dx), jnp.abs(x32), heads)
  assert out.dtype == dtype and xd.shape == (n_tok, heads)
  for k in (0, 2):
    np.testing.assert_array_equal(np.asarray(out[k], np.float32),
                                  np.asarray(buf[k], np.float32))
  assert rel(out[1], dx) <= TOL[dtype]
  assert rel(dscale, want_dscale) <= TOL[dtype]
  err = np.abs(np.asarray(xd, np.float64) - np.asarray(want_xd, np.float64))
  assert np.isfinite(err).all()
  assert err.max() <= TOL[dtype] * float(jnp.max(size_xd))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("lead,d,heads,n,blocks,site_group,below", [
    ((3, 160), 1280, 8, 17, None, 16, None),
    ((2, 37), 64, 4, 40, None, 16, None),
    ((3, 160), 1280, 8, 6, None, 0, None),
    ((2, 37), 64, 4, 5, (0, 0, 1, 1, 1), 0, None),
    # the lowest sites only (groups (0, 15), (15, 31), (31, 41) cut at 20)
    pytest.param((2, 37), 64, 4, 40, None, 16, 20, id="below20-full"),
    pytest.param((2, 37), 64, 4, 5, (0, 0, 1, 1, 1), 0, 3,
                 id="below3-blocks"),
    # none recomputed: every norm's gradient by triton_stack.norm_grad
    pytest.param((3, 160), 1280, 8, 17, None, 16, 0, id="below0-full"),
    pytest.param((2, 37), 64, 4, 5, (0, 0, 1, 1, 1), 0, 0,
                 id="below0-blocks")])
def test_triton_stack_recomputed_site_outputs(dtype, lead, d, heads, n,
                                              blocks, site_group, below):
  """``routed_stack(norm=...)`` on Triton (the sites' outputs recomputed in
  the backward: groups by the causal ``sites_kernel`` over the source
  buffer, else site by site; ``below``: the lowest sites only) against the
  jnp reference with the norm inside each sublayer; values and every
  gradient (the norms' gains too), as :func:`assert_matches` compares
  them."""
  check_normed_stack(dtype, lead, d, heads, n, blocks, site_group, below,
                     sublayer, normed_sublayer)


def check_normed_stack(dtype, lead, d, heads, n, blocks, site_group, below,
                       apply, normed, products=1):
  """``routed_stack(h, params, apply, ..., norm=...)`` on Triton against the
  jnp reference of ``normed`` (the norm inside each sublayer) on fresh
  random inputs: values and every gradient, as :func:`assert_matches`
  compares them. ``products``: the matrix products of ``x`` in ``apply``
  (each weight scaled by ``1 / sqrt(products d)``)."""
  ks = jax.random.split(jax.random.key(d + n + 1), 6)
  h = (jax.random.normal(ks[0], (*lead, d)) * 2 + 0.5).astype(dtype)
  params = tuple({"w": jax.random.normal(k, (d, d)) / np.sqrt(products * d),
                  "b": 0.1 * jax.random.normal(jax.random.fold_in(k, 1), (d,)),
                  "g": 1 + 0.3 * jax.random.normal(jax.random.fold_in(k, 2),
                                                   (d,))}
                 for k in jax.random.split(ks[1], n))
  queries = 0.5 * jax.random.normal(ks[2], (n + 1, d)) / np.sqrt(d / heads)
  gains = 1 + 0.3 * jax.random.normal(ks[3], (n + 1, d))
  cot = jax.random.normal(ks[4], lead + (d,))

  def run(h, impl):
    if impl == "reference":
      return grads("reference", h, params, queries, gains, cot, heads,
                   blocks, 0, normed)
    norm = SublayerRMSNorm(gain, 1e-6)

    def f(h, params, queries, gains):
      out = routed_stack(h, params, apply, queries, gains,
                         jnp.asarray(1.3, jnp.float32), num_heads=heads,
                         impl="triton", blocks=blocks, norm=norm,
                         site_group=site_group, recompute_below=below)
      return jnp.sum(out.astype(jnp.float32) * cot), out
    return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3), has_aux=True))(
        h, params, queries, gains)

  got = run(h, "triton")
  want = run(h, "reference")
  assert_matches(dtype, got, want,
                 lambda: run(h.astype(jnp.float32), "reference"))


def fanout_sublayer(j, p, x, consts):
  """Three products of ``x`` in its dtype (as attention's Q, K and V): its
  cotangent is a sum of three terms."""
  w, b = p["w"].astype(x.dtype), p["b"].astype(x.dtype)
  y = jnp.tanh(x @ w + b) + 0.3 * jnp.tanh(x @ w.T) + 0.1 * (x @ (w * b))
  return (y * (1.0 + 0.1 * j) * consts).astype(x.dtype)


def normed_fanout(j, p, x, consts):
  return fanout_sublayer(j, p, norm(j, p, x), consts)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("lead,d,heads,n,blocks,site_group", [
    ((3, 160), 1280, 8, 17, None, 16),
    ((2, 37), 64, 4, 5, (0, 0, 1, 1, 1), 0)])
def test_triton_stack_norm_kernel_adds_terms(monkeypatch, dtype, lead, d,
                                             heads, n, blocks, site_group):
  """``routed_stack(norm=...)`` on Triton with ``NORM_TUNING["dy_terms"]``
  3 and sublayers reading their input in three products: every norm's
  gradient by the kernel from the three terms of its cotangent (no sum in
  XLA), against the jnp reference; values and every gradient."""
  from mhar_jax.kernels import triton_route, triton_stack
  monkeypatch.setitem(triton_stack.NORM_TUNING, "dy_terms", 3)
  ndy = []
  launch = triton_route._launch

  def counted(kernel, *a, **k):
    if "NDY" in k:
      ndy.append(k["NDY"])
    return launch(kernel, *a, **k)

  monkeypatch.setattr(triton_route, "_launch", counted)
  check_normed_stack(dtype, lead, d, heads, n, blocks, site_group, 0,
                     fanout_sublayer, normed_fanout, products=3)
  assert ndy == [3] * n, ndy


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("d,heads,gv,s", [(1280, 8, 16, 31), (512, 16, 9, 9),
                                          (1024, 8, 2, 49), (1280, 8, 1, 5),
                                          # C = 16; S whole source blocks
                                          (64, 4, 4, 16), (1280, 8, 3, 32)])
def test_causal_sites_kernel_against_jnp(dtype, d, heads, gv, s):
  """``sites_kernel`` with ``causal``: G consecutive sites, site g over the
  first S - G + g + 1 rows of a source buffer (rows past S hold other
  data), against each site's jnp routing over its own rows (fp32 at the
  highest matmul precision); 1000 tokens; outputs poisoned first."""
  from mhar_jax.kernels import reference, stack, triton_route, triton_stack
  n_tok, rows = 1000, s + 3
  ks = jax.random.split(jax.random.key(d + gv + s), 2)
  buf = (jax.random.normal(ks[0], (rows, n_tok, d)) * 1.3).astype(dtype)
  r = reference.inv_rms(buf, 1e-6)
  t = 0.5 * jax.random.normal(ks[1], (gv, d)) / np.sqrt(d / heads)
  plan = stack._Plan(heads, 1e-6, "reference")
  with jax.default_matmul_precision("highest"):
    want = [stack._sites([buf[i].astype(jnp.float32)
                          for i in range(s - gv + k + 1)],
                         t[k:k + 1].reshape(1, heads, -1),
                         list(r[:s - gv + k + 1]), plan) for k in range(gv)]
  with triton_route.poison_outputs():
    got = jax.jit(lambda b, r, t: triton_stack.sites_local(
        b, r, s, t, heads, causal=True))(buf, r[:s], t)
  for k, (out, lse) in enumerate(want):
    assert rel(got[0][k], out[0]) <= TOL[dtype], k
    assert rel(got[1][k], lse[0]) <= (1e-5 if dtype == jnp.float32
                                      else 1e-4), k


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("d,heads,gv,m", [(1280, 8, 16, 37), (512, 16, 9, 5),
                                          (1024, 8, 16, 1), (1280, 8, 16, 32),
                                          # C = 16; 16 rows (whole blocks)
                                          (64, 4, 4, 9), (1280, 8, 4, 9)])
def test_group_kernels_match_reference(dtype, d, heads, gv, m):
  """The tensor-core kernels alone on fresh inputs against their jnp
  references (fp32 computed at the highest matmul precision): G sites over
  the first rows of a source buffer, and G sources' share of the sites
  above them (acc, coef, query-gain gradient); 1000 tokens (the last
  program's are partly past the end); outputs poisoned first."""
  from mhar_jax.kernels import reference, stack, triton_route, triton_stack
  n_tok, rows = 1000, gv + m + 3
  ks = jax.random.split(jax.random.key(d + gv + m), 6)
  buf = (jax.random.normal(ks[0], (rows, n_tok, d)) * 1.3).astype(dtype)
  r = reference.inv_rms(buf, 1e-6)
  t = 0.5 * jax.random.normal(ks[1], (rows, d)) / np.sqrt(d / heads)
  with jax.default_matmul_precision("highest"):
    want = stack._sites([buf[i].astype(jnp.float32) for i in range(rows)],
                        t[:gv].reshape(gv, heads, -1), list(r),
                        stack._Plan(heads, 1e-6, "reference"))
  with triton_route.poison_outputs():
    got = jax.jit(lambda b, r, t: triton_stack.sites_local(
        b, r, rows, t, heads))(buf, r, t[:gv])
  tol = TOL[dtype]
  # log-sum-exps: the bf16 path's queries are two bf16 terms (~16 bits)
  assert rel(got[0], want[0]) <= tol
  assert rel(got[1], want[1]) <= (1e-5 if dtype == jnp.float32 else 1e-4)
  # sources 2 .. 2+gv-1, sites gv+2 .. gv+m+1 (a log-sum-exp of a real site)
  i0, j = 2, gv + 2
  dX = jax.random.normal(ks[2], (rows, n_tok, d)).astype(dtype)
  lse = jnp.stack(list(want[1][:1]) * rows).astype(jnp.float32) + 0.5
  xd = jax.random.normal(ks[3], (rows, n_tok, heads))
  rg = r[i0:i0 + gv]
  with jax.default_matmul_precision("highest"):
    want = stack.sources_partial(buf[i0:i0 + gv].astype(jnp.float32), rg,
                                 dX.astype(jnp.float32), t, lse, xd, j, m,
                                 heads)
  with triton_route.poison_outputs():
    got = jax.jit(lambda *a: triton_stack.sources_partial_local(
        a[0], i0, gv, *a[1:], j, m, heads))(buf, rg, dX, t, lse, xd)
  for a, b in zip(got, want):
    assert a.shape == b.shape
    assert rel(a, b) <= tol, rel(a, b)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("d,heads,gv,m1,m2", [(1280, 8, 16, 16, 16),
                                              (1024, 8, 1, 5, 16)])
def test_group_kernels_split_cotangents(dtype, d, heads, gv, m1, m2):
  """The sites' cotangents in two buffers at row offsets (the backward with
  recomputed sources, and with blocks): G sources' share of both, the second
  call continuing the first's (acc, coef) in place, a source's gradient from
  one buffer's rows and from both (the upper's sums, ``partial``, continued
  by the lower's), against the jnp references on one whole buffer; the share
  also written into the first rows of a longer buffer (``into``), its other
  rows kept; and both buffers read by one launch of the share's kernel
  where the second starts a whole site block; outputs poisoned first."""
  from mhar_jax.kernels import reference, stack, triton_route, triton_stack
  n_tok, j = 1000, 3
  rows = j + m1 + m2
  ks = jax.random.split(jax.random.key(d + gv), 5)
  S = (jax.random.normal(ks[0], (gv, n_tok, d)) * 1.3).astype(dtype)
  r = reference.inv_rms(S, 1e-6)
  t = 0.5 * jax.random.normal(ks[1], (rows, d)) / np.sqrt(d / heads)
  dX = jax.random.normal(ks[2], (rows, n_tok, d)).astype(dtype)
  u = jnp.einsum("gnhc,khc->gknh",
                 S.astype(jnp.float32).reshape(gv, n_tok, heads, -1),
                 t.reshape(rows, heads, -1))
  lse = (r[:, None, :, None] * u).max(0) + 0.5          # w <= 1, as a site's
  xd = jax.random.normal(ks[3], (rows, n_tok, heads))
  lower = jnp.concatenate([dX[:1], dX[j:j + m1]])       # site j in row 1
  upper = dX[j + m1:]                                  # site j + m1 in row 0
  with jax.default_matmul_precision("highest"):
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = stack.sources_partial(f32(S), r, f32(dX), t, lse, xd, j, m1 + m2,
                                 heads)
    want_ds = stack.source_grad(f32(S[0]), r[0], f32(dX), t, lse, xd, j,
                                heads, m1)
    want_both = stack.source_grad(f32(S[0]), r[0], f32(dX), t, lse, xd, j,
                                  heads, m1 + m2)

  def split(S, r, lower, upper, t, lse, xd):
    a = triton_stack.sources_partial_local(S, 0, gv, r, lower, t, lse, xd, j,
                                           m1, heads, dx_row=1)
    b = triton_stack.sources_partial_local(S, 0, gv, r, upper, t, lse, xd,
                                           j + m1, m2, heads, init=a[:2],
                                           dx_row=0)
    ds = triton_stack.source_grad_local(S[0], r[0], lower, t, lse, xd, j,
                                        heads, m1, dx_row=1)
    up = triton_stack.source_grad_local(S[0], r[0], upper, t, lse, xd,
                                        j + m1, heads, m2, dx_row=0,
                                        partial=True)
    both = triton_stack.source_grad_local(S[0], r[0], lower, t, lse, xd, j,
                                          heads, m1, init=up[:2], dx_row=1)
    # the share into the first rows of a longer buffer, its last row kept
    into = jnp.full((gv + 1, n_tok, d), 7.0, dtype)
    a2 = triton_stack.sources_partial_local(S, 0, gv, r, lower, t, lse, xd,
                                            j, m1, heads, dx_row=1, into=into)
    b2 = triton_stack.sources_partial_local(S, 0, gv, r, upper, t, lse, xd,
                                            j + m1, m2, heads, init=a2[:2],
                                            dx_row=0)
    # both buffers read by one launch (the upper starts a whole site block)
    one = (triton_stack.sources_partial_local(
        S, 0, gv, r, [(lower, 1, m1), (upper, 0, m2)], t, lse, xd, j,
        m1 + m2, heads) if m1 % triton_stack.SOURCES_TUNING["site_block"] == 0
        else ())
    return ((b[0], b[1], jnp.concatenate([a[2], b[2]])), ds,
            (both[0], jnp.concatenate([both[1], up[2]])), (b2[0], b[0]), one)

  with triton_route.poison_outputs():
    got, ds, both, (merged, alone), one = jax.jit(split)(
        S, r, lower, upper, t, lse, xd)
  for a, b in [*zip(got, want), *zip(ds, want_ds), *zip(both, want_both),
               *zip(one, want)]:
    assert a.shape == b.shape
    assert rel(a, b) <= TOL[dtype], rel(a, b)
  assert merged.shape == (gv + 1, n_tok, d)
  np.testing.assert_array_equal(np.asarray(merged[gv], np.float32), 7.0)
  np.testing.assert_array_equal(np.asarray(merged[:gv], np.float32),
                                np.asarray(alone, np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("d,heads,g,m", [(1280, 8, 1, 37), (1280, 8, 16, 48),
                                         (1024, 1, 1, 73), (512, 16, 9, 5)])
@pytest.mark.parametrize("n_tok,tuning", [
    (1000, {}),                        # ragged chunks, misaligned rows
    (1024, {"sites16": "2x32", "sites32": "8x128", "sites64": "2x32"})])
def test_query_gain_grad_matches_einsum(monkeypatch, dtype, d, heads, g, m,
                                        n_tok, tuning):
  """The query-gain gradient's product over token rows of a buffer (read in
  place) against the einsum at the highest precision, in both callers'
  layouts of ``dlr``, under the default tunings and others; output poisoned
  first."""
  from mhar_jax.kernels import triton_route, triton_stack
  for key, value in tuning.items():
    monkeypatch.setitem(triton_stack.QGRAD_TUNING, key, value)
  row = 2
  ks = jax.random.split(jax.random.key(d + g + m), 2)
  S = jax.random.normal(ks[0], (row + g + 1, n_tok, d)).astype(dtype)
  src = S[row:row + g].astype(jnp.float32).reshape(g, n_tok, heads, -1)
  if g == 1:
    dlr = jax.random.normal(ks[1], (m, heads, n_tok))
    strides, spec = (1, heads * n_tok, n_tok), "mhn,nhc->mhc"
    src = src[0]
  else:
    dlr = jax.random.normal(ks[1], (g, n_tok, heads, m))
    strides, spec = (heads * m, 1, m), "gnhm,gnhc->mhc"
  with jax.default_matmul_precision("highest"):
    want = jnp.einsum(spec, dlr, src).reshape(m, d)
  with triton_route.poison_outputs():
    got = jax.jit(lambda dlr, S: triton_stack.query_gain_grad(
        dlr, strides, S, row, g * n_tok, m, heads))(dlr, S)
  assert rel(got, want) <= (1e-5 if dtype == jnp.float32 else 1e-4)
