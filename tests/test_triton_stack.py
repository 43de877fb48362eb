"""The source-major backward kernel (kernels/triton_stack.py) under Triton's interpreter.

Runs on CPU where ``triton`` and ``torch`` are installed (``TRITON_INTERPRET=1``
executes the kernel in numpy); skipped elsewhere. It checks the kernel's
indexing and math against ``stack.source_grad``; the GPU build and its speed
are checked on the device (benchmarks/).
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

if jax.default_backend() == "gpu":   # there tests/test_stack_gpu.py runs the real build
  pytest.skip("interpreter test: CPU only", allow_module_level=True)
from helpers import (interpreted_kernels, interpreted_launch,  # noqa: E402
                     jnp_fwd_local, use_triton_interpreter)

torch = pytest.importorskip("torch")
use_triton_interpreter()
triton = pytest.importorskip("triton")

from mhar_jax.kernels import reference, stack  # noqa: E402


@pytest.fixture(scope="module")
def kernel_module():
  yield from interpreted_kernels("mhar_jax.kernels.triton_route",
                                 "mhar_jax.kernels.triton_stack")



@pytest.mark.parametrize("n_tok,d,h,one_program", [
    (37, 64, 4, False), (37, 64, 4, True),   # one program: every tile in turn
    (6, 320, 2, True),     # C = 160 = 128 + 32, as at 1b
    (5, 48, 16, False), (9, 24, 1, True), (3, 40, 8, False)])
@pytest.mark.parametrize("stages", [3, 1])
@pytest.mark.parametrize("x_row,terms", [(None, 1), (2, 1), (None, 3),
                                         (2, 2)])
def test_norm_grad_matches_autodiff(kernel_module, monkeypatch, n_tok, d, h,
                                    one_program, stages, x_row, terms):
  """``norm_grad_local`` (the kernel through the jax-triton stand-in) against
  the VJP of ``reference.rms_norm`` and ``stack.dot_heads``: ``dx`` in its row
  of the buffer (the other rows kept), ``<dx, x>`` per head, the gain's
  gradient summed over the programs. ``one_program``: one program takes
  every tile in turn, tiles of the fewest tokens (2 pipelined, 1 with
  ``stages`` 1). ``x_row``: the input is that row of an array of rows (a
  recomputed group's outputs), read in place. ``terms``: ``dy`` given as
  that many arrays, which the kernel adds."""
  ts = kernel_module
  monkeypatch.setattr(ts.tr, "_launch", interpreted_launch)
  monkeypatch.setitem(ts.NORM_TUNING, "stages", stages)
  if one_program:
    monkeypatch.setattr(ts.tr, "_num_sms", lambda: 1)
    monkeypatch.setitem(ts.NORM_TUNING, "programs_per_sm", 1)
    monkeypatch.setitem(ts.NORM_TUNING, "elems_per_thread", 1)
    monkeypatch.setitem(ts.NORM_TUNING, "warps", 1)
    bn, progs = ts.norm_grad_programs(n_tok, d, h)
    assert progs == 1 and bn == (1 if stages == 1 else 2), (bn, progs)
  rng = np.random.default_rng(n_tok + d + h)
  x = jnp.asarray(rng.normal(size=(n_tok, d)) * 1.7, jnp.float32)
  dy = jnp.asarray(rng.normal(size=(n_tok, d)), jnp.float32)
  scale = jnp.asarray(1 + 0.3 * rng.normal(size=d), jnp.float32)
  buf = jnp.asarray(rng.normal(size=(3, n_tok, d)), jnp.float32)
  xs = x if x_row is None else jnp.asarray(
      rng.normal(size=(3, n_tok, d)), jnp.float32).at[x_row].set(x)
  parts = [jnp.asarray(rng.normal(size=(n_tok, d)), jnp.float32)
           for _ in range(terms - 1)]
  out, xd, dscale = ts.norm_grad_local(
      xs, scale, [dy - sum(parts)] + parts if terms > 1 else dy, 1e-6, h,
      buf, 1, x_row)
  _, vjp = jax.vjp(lambda x, s: reference.rms_norm(x, s, 1e-6), x, scale)
  dx, dscale_ref = vjp(dy)
  np.testing.assert_array_equal(out[0], buf[0])
  np.testing.assert_array_equal(out[2], buf[2])
  # <dx, x> cancels (exactly 0 over all channels as eps -> 0): its error is
  # measured against the size of its terms, sum_c |dx_c x_c|.
  for a, b, size in ((out[1], dx, dx), (dscale, dscale_ref, dscale_ref),
                     (xd, stack.dot_heads(dx, x, h),
                      stack.dot_heads(jnp.abs(dx), jnp.abs(x), h))):
    np.testing.assert_allclose(a, b, rtol=0,
                               atol=1e-5 * float(jnp.abs(size).max()))

def _site_buffers(rng, s, h, rows):
  """Random site buffers ``(dX, t, lse, xd)`` for sources ``s [G, N, D]``,
  with each log-sum-exp at least every source's logit (w <= 1, as in a real
  site)."""
  g, n_tok, d = s.shape
  r = np.asarray(reference.inv_rms(jnp.asarray(s), 1e-6))
  dX = rng.normal(size=(rows, n_tok, d)).astype(np.float32)
  t = rng.normal(size=(rows, d)).astype(np.float32)
  u = np.einsum("gnhc,khc->gknh", s.reshape(g, n_tok, h, d // h),
                t.reshape(rows, h, d // h))
  lse = ((r[:, None, :, None] * u).max(0)
         + np.abs(rng.normal(size=(rows, n_tok, h))) + 0.1).astype(np.float32)
  xd = rng.normal(size=(rows, n_tok, h)).astype(np.float32)
  return r, *(jnp.asarray(a) for a in (dX, t, lse, xd))


@pytest.mark.parametrize("n_tok,d,h,rows,i,m,init", [
    (37, 64, 4, 5, 0, None, False), (16, 40, 8, 3, 2, None, False),
    (9, 24, 1, 4, 3, None, False), (5, 48, 16, 2, 1, None, False),
    (19, 64, 4, 6, 2, 1, False),   # a block partial sum: one reader, mid-stack
    (11, 40, 8, 7, 1, 3, False),   # readers that stop before the last row
    (6, 320, 2, 4, 1, None, False),    # C = 160 = 128 + 32, as at 1b
    (11, 40, 8, 7, 1, 3, True),    # continuing the share of later sites
    (6, 320, 2, 4, 1, 2, True)])
def test_kernel_matches_reference(kernel_module, n_tok, d, h, rows, i, m,
                                  init):
  """``source_grad_local`` (the kernel through the jax-triton stand-in)
  against ``stack.source_grad``; with ``init``, continuing a random share of
  later sites."""
  rng = np.random.default_rng(n_tok + d)
  s = rng.normal(size=(1, n_tok, d)).astype(np.float32)
  r, dX, t, lse, xd = _site_buffers(rng, s, h, rows)
  s, r = jnp.asarray(s[0]), jnp.asarray(r[0])
  start = None
  if init:
    start = (jnp.asarray(rng.normal(size=(n_tok, d)), jnp.float32),
             jnp.asarray(rng.normal(size=(n_tok, h)), jnp.float32))
  ds_ref, dt_ref = stack.source_grad(s, r, dX, t, lse, xd, i, h, m, start)
  ts = kernel_module
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(ts.tr, "_launch", interpreted_launch)
    ds, dt = ts.source_grad_local(s, r, dX, t, lse, xd, i, h, m, start)
  assert dt.shape == dt_ref.shape == (rows - i if m is None else m, d)
  np.testing.assert_allclose(ds, ds_ref, rtol=0,
                             atol=1e-5 * float(jnp.abs(ds_ref).max()))
  np.testing.assert_allclose(dt, dt_ref, rtol=0,
                             atol=1e-5 * float(jnp.abs(dt_ref).max()))


@pytest.mark.parametrize("n_tok,d,h,rows,row,g,m,bk,chunk", [
    (70, 320, 2, 4, 1, 1, 5, 16, 16),   # C = 160 = 128 + 32; ragged
    (37, 192, 2, 5, 2, 3, 70, 16, 32),  # C = 96; 70 sites: two site blocks
    (20, 128, 1, 2, 0, 2, 1, 64, 1024),  # AttnRes: C = 128, one site
    (33, 64, 4, 3, 2, 1, 16, 8, 8),     # C = 16; chunks of one step
    (64, 320, 2, 4, 1, 2, 8, 16, 32),   # whole token steps; aligned rows
    (32, 352, 2, 3, 0, 2, 8, 16, 16),   # C = 176 = 128 + 48 (lanes masked)
    (24, 512, 2, 3, 1, 2, 20, 16, 16)])  # C = 256: blocks of 128 channels
@pytest.mark.parametrize("layout", ["source", "group"])
def test_query_gain_grad_matches_einsum(kernel_module, n_tok, d, h, rows, row,
                                        g, m, bk, chunk, layout):
  """``query_gain_grad`` (the query-gain gradient's product over token rows
  of a buffer, read in place) against the einsum it replaces, for both
  callers' layouts: one source's ``dlr [M, H, N]`` and a group's ``[G, N,
  H, M]``."""
  ts = kernel_module
  rng = np.random.default_rng(n_tok + m)
  S = jnp.asarray(rng.normal(size=(rows + g, n_tok, d)), jnp.float32)
  c = d // h
  src = S[row:row + g].reshape(g, n_tok, h, c)
  if layout == "source":
    g = 1
    src = src[:1]
    dlr = jnp.asarray(rng.normal(size=(m, h, n_tok)), jnp.float32)
    strides = (1, h * n_tok, n_tok)
    want = jnp.einsum("mhn,nhc->mhc", dlr, src[0])
  else:
    dlr = jnp.asarray(rng.normal(size=(g, n_tok, h, m)), jnp.float32)
    strides = (h * m, 1, m)
    want = jnp.einsum("gnhm,gnhc->mhc", dlr, src)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(ts.tr, "_launch", interpreted_launch)
    for mb in (16, 32, 64):
      mp.setitem(ts.QGRAD_TUNING, f"sites{mb}", f"4x{bk}")
    mp.setitem(ts.QGRAD_TUNING, "chunk_tokens", chunk)
    got = ts.query_gain_grad(dlr, strides, S, row, g * n_tok, m, h)
  assert got.shape == (m, d)
  np.testing.assert_allclose(got, want.reshape(m, d), rtol=0,
                             atol=1e-5 * float(jnp.abs(want).max()))


def test_query_gain_tuning_names_a_bad_value(kernel_module, monkeypatch):
  """A warps x tokens tuning that is not ``"WxT"`` fails naming the key."""
  monkeypatch.setitem(kernel_module.QGRAD_TUNING, "sites32", "4-64")
  with pytest.raises(ValueError, match="sites32.*'4-64'"):
    kernel_module.qgrad_launch(160, 20)


@pytest.mark.parametrize("n_tok,d,h,rows,i0,gv,j,m,bt", [
    (5, 320, 2, 12, 2, 4, 6, 5, 2),    # C = 160 = 128 + 32; 4 of 16 rows
    (3, 64, 4, 40, 0, 16, 16, 24, 4),  # two site blocks, the second ragged
    (4, 128, 1, 6, 3, 2, 5, 1, 8),     # one site; AttnRes (H = 1); BT > N
    (3, 64, 4, 40, 0, 8, 8, 32, 4),    # whole site blocks: the unmasked loop
    (5, 320, 2, 24, 2, 4, 8, 16, 2),   # ... with C = 128 + 32
])
def test_sources_partial_matches_reference(kernel_module, n_tok, d, h, rows,
                                           i0, gv, j, m, bt):
  """``sources_partial_local`` (G sources' gradients from the sites above
  them, on tensor cores; fp32 operands: the interpreter's bf16 products are
  wrong) against ``stack.sources_partial``, and ``source_grad`` continuing
  it against ``source_grad`` over all the sites."""
  ts = kernel_module
  rng = np.random.default_rng(n_tok + d + m)
  buf = rng.normal(size=(rows, n_tok, d)).astype(np.float32)
  r, dX, t, lse, xd = _site_buffers(rng, buf[i0:i0 + gv], h, rows)
  buf, r = jnp.asarray(buf), jnp.asarray(r)
  want = stack.sources_partial(buf[i0:i0 + gv], r, dX, t, lse, xd, j, m, h)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(ts.tr, "_launch", interpreted_launch)
    mp.setitem(ts.SOURCES_TUNING, "tokens_per_program", bt)
    got = ts.sources_partial_local(buf, i0, gv, r, dX, t, lse, xd, j, m, h)
  for a, b in zip(got, want):
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=0,
                               atol=1e-5 * float(jnp.abs(b).max()))
  if j + m == rows:     # the share of every later site: continue it
    for g in range(gv):
      i = i0 + g
      full, _ = stack.source_grad(buf[i], r[g], dX, t, lse, xd, i, h)
      ds, _ = stack.source_grad(buf[i], r[g], dX, t, lse, xd, i, h, j - i,
                                (got[0][g], got[1][g]))
      np.testing.assert_allclose(ds, full, rtol=0,
                                 atol=1e-5 * float(jnp.abs(full).max()))


@pytest.mark.parametrize("n_tok,d,h,gv,m1,m2", [
    (5, 320, 2, 3, 4, 16),   # C = 128 + 32; a ragged span, then a whole block
    (3, 64, 4, 1, 16, 5)])   # one source (a depth's last group)
def test_cotangents_split_over_buffers(kernel_module, n_tok, d, h, gv, m1,
                                       m2):
  """The sites' cotangents held in two buffers at row offsets: the share of
  both (``sources_partial_local`` on the first, continued in place on the
  second; also written into the first rows of a bigger buffer, ``into``,
  whose other rows it keeps), a source's gradient from one (``source_grad_local``,
  ``dx_row``) and from both (the upper's sums, ``partial``, continued by the
  lower's) against the reference on one whole-stack buffer."""
  ts = kernel_module
  rng = np.random.default_rng(gv + m1)
  rows, j = 2 + m1 + m2, 2
  S = rng.normal(size=(gv, n_tok, d)).astype(np.float32)
  r, dX, t, lse, xd = _site_buffers(rng, S, h, rows)
  S, r = jnp.asarray(S), jnp.asarray(r)
  lower = jnp.concatenate([dX[:1], dX[j:j + m1]])          # site j in row 1
  upper = dX[j + m1:]                                     # site j+m1 in row 0
  want = stack.sources_partial(S, r, dX, t, lse, xd, j, m1 + m2, h)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(ts.tr, "_launch", interpreted_launch)
    a = ts.sources_partial_local(S, 0, gv, r, lower, t, lse, xd, j, m1, h,
                                 dx_row=1)
    b = ts.sources_partial_local(S, 0, gv, r, upper, t, lse, xd, j + m1, m2,
                                 h, init=a[:2], dx_row=0)
    # the same into the first rows of a bigger buffer, its last row kept
    into = jnp.full((gv + 1, n_tok, d), 7.0, jnp.float32)
    a2 = ts.sources_partial_local(S, 0, gv, r, lower, t, lse, xd, j, m1, h,
                                  dx_row=1, into=into)
    b2 = ts.sources_partial_local(S, 0, gv, r, upper, t, lse, xd, j + m1, m2,
                                  h, init=a2[:2], dx_row=0)
    ds, dt = ts.source_grad_local(S[0], r[0], lower, t, lse, xd, j, h, m1,
                                  dx_row=1)
    up = ts.source_grad_local(S[0], r[0], upper, t, lse, xd, j + m1, h, m2,
                              dx_row=0, partial=True)
    both = ts.source_grad_local(S[0], r[0], lower, t, lse, xd, j, h, m1,
                                init=up[:2], dx_row=1)
  got = (b[0], b[1], jnp.concatenate([a[2], b[2]]))
  assert b2[0].shape == (gv + 1, n_tok, d)
  np.testing.assert_array_equal(b2[0][gv], 7.0)
  np.testing.assert_array_equal(b2[0][:gv], b[0])
  np.testing.assert_array_equal(b2[1], b[1])
  for x, y in zip(got, want):
    assert x.shape == y.shape
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-5 * float(jnp.abs(y).max()))
  for (ds, dt), m in (((ds, dt), m1),
                      ((both[0], jnp.concatenate([both[1], up[2]])), m1 + m2)):
    ds_ref, dt_ref = stack.source_grad(S[0], r[0], dX, t, lse, xd, j, h, m)
    np.testing.assert_allclose(ds, ds_ref, rtol=0,
                               atol=1e-5 * float(jnp.abs(ds_ref).max()))
    np.testing.assert_allclose(dt, dt_ref, rtol=0,
                               atol=1e-5 * float(jnp.abs(dt_ref).max()))


@pytest.mark.parametrize("n_tok,d,h,gv,counts,mb,into", [
    (5, 320, 2, 3, (4, 4, 4, 3), 4, False),  # C = 128 + 32; four buffers
    (3, 64, 4, 16, (16, 5), 16, True),       # two, the last ragged; into
    (4, 64, 4, 2, (8, 8, 8), 8, False)])     # three whole blocks: unmasked
def test_sources_partial_reads_several_buffers(kernel_module, n_tok, d, h,
                                               gv, counts, mb, into):
  """One ``sources_kernel`` launch reading the sites' cotangents from up to
  four buffers (``dX`` as pieces ``(buffer, first row, sites)``, each at its
  own row offset) against the reference on one whole-stack buffer; pieces
  that would split a site block are refused before any launch."""
  ts = kernel_module
  rng = np.random.default_rng(sum(counts))
  m, j = sum(counts), 2
  S = rng.normal(size=(gv, n_tok, d)).astype(np.float32)
  r, dX, t, lse, xd = _site_buffers(rng, S, h, j + m)
  S, r = jnp.asarray(S), jnp.asarray(r)
  pieces, lo = [], j
  for p, k in enumerate(counts):      # piece p: p spare rows, then its sites
    pieces.append((jnp.concatenate([dX[:p], dX[lo:lo + k]]), p, k))
    lo += k
  want = stack.sources_partial(S, r, dX, t, lse, xd, j, m, h)
  buf = jnp.full((gv + 1, n_tok, d), 7.0, jnp.float32) if into else None
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(ts.tr, "_launch", interpreted_launch)
    mp.setitem(ts.SOURCES_TUNING, "site_block", mb)
    got = ts.sources_partial_local(S, 0, gv, r, pieces, t, lse, xd, j, m, h,
                                   into=buf)
    with pytest.raises(ValueError, match="multiple of"):
      ts.sources_partial_local(S, 0, gv, r, [(dX, j, 1), (dX, j + 1, m - 1)],
                               t, lse, xd, j, m, h)
  if into:
    np.testing.assert_array_equal(got[0][gv], 7.0)
    got = (got[0][:gv], *got[1:])
  for x, y in zip(got, want):
    assert x.shape == y.shape
    np.testing.assert_allclose(x, y, rtol=0,
                               atol=1e-5 * float(jnp.abs(y).max()))


def test_mergeable_pieces(kernel_module, monkeypatch):
  """Cotangent spans cut into launches: at most ``max_buffers`` a launch,
  a span joining only where it starts a whole site block into its launch."""
  ts = kernel_module
  monkeypatch.setitem(ts.SOURCES_TUNING, "site_block", 16)
  monkeypatch.setitem(ts.SOURCES_TUNING, "max_buffers", 4)
  assert ts.mergeable_pieces([16, 16, 16, 16, 16]) == [4, 1]
  assert ts.mergeable_pieces([9]) == [1]
  assert ts.mergeable_pieces([16, 9, 16]) == [2, 1]
  assert ts.mergeable_pieces([8, 16, 16]) == [1, 2]
  monkeypatch.setitem(ts.SOURCES_TUNING, "max_buffers", 1)
  assert ts.mergeable_pieces([16, 16, 16]) == [1, 1, 1]


def _sublayer(j, p, x, consts):
  return jnp.tanh(x @ p["w"] + p["b"]) * (1.0 + 0.1 * j)


def _fanout(j, p, x, consts):
  """``_sublayer`` with two more products of ``x`` (as attention's Q, K and
  V): its cotangent is a sum of three terms."""
  w = p["w"]
  return (_sublayer(j, p, x, consts) + 0.3 * jnp.tanh(x @ w.T)
          + 0.1 * (x @ (w * p["b"])))


def _project(j, p, u):
  """An output projection for every other sublayer (identity between)."""
  return u @ p["w"].T if j % 2 else u


def _stack_problem(seed, n, d, h, tok=(2, 3), norm_gains=False):
  """``(x0, params, queries, gains, cotangent)`` of a stack of ``n``
  sublayers (``_sublayer``'s ``w``, ``b``; ``norm_gains``: also ``_norm``'s
  ``g``) at width ``d``, ``h`` heads, tokens ``tok``, float32."""
  rng = np.random.default_rng(seed)
  x0 = jnp.asarray(rng.normal(size=(*tok, d)), jnp.float32)

  def sublayer_params():
    p = {"w": jnp.asarray(rng.normal(size=(d, d)) / np.sqrt(d), jnp.float32),
         "b": jnp.asarray(0.1 * rng.normal(size=d), jnp.float32)}
    if norm_gains:
      p["g"] = jnp.asarray(1 + 0.3 * rng.normal(size=d), jnp.float32)
    return p

  params = tuple(sublayer_params() for _ in range(n))
  q = jnp.asarray(0.5 * rng.normal(size=(n + 1, d)) / np.sqrt(d / h),
                  jnp.float32)
  g = jnp.asarray(1 + 0.2 * rng.normal(size=(n + 1, d)), jnp.float32)
  cot = jnp.asarray(rng.normal(size=(*tok, d)), jnp.float32)
  return x0, params, q, g, cot


@pytest.mark.parametrize("n,blocks,given_r,site_group,src_groups,project", [
    (5, None, True, 0, 0, None), (5, None, False, 0, 0, None),
    (5, (0, 0, 1, 1, 1), True, 0, 0, None),
    (5, None, True, 3, 1, None),        # backward: [3, 6) has no site above
    (5, None, True, 3, 1, _project),    # ... its sources recomputed
    (5, (0, 0, 1, 1, 1), True, 2, 0, None),
    (5, (0, 0, 1, 1, 1), True, 0, 0, _project),   # block sums recomputed
    (8, None, True, 3, 3, _project),    # [0, 3) under [3, 6) and [6, 9)
    # sites 0-14, 15-30 (16 sources), 31-33 (32): whole source blocks;
    # backward [2, 18) and [0, 2) under 16 and 32 sites: whole site blocks
    (33, None, True, 16, 2, None)])
def test_routed_stack_end_to_end(kernel_module, monkeypatch, n, blocks,
                                 given_r, site_group, src_groups, project):
  """``routed_stack``'s Triton path as the decoder runs it (forward kernels
  given each source's inverse RMS or not, groups of sites on tensor cores
  reading the in-place source buffer, the whole-stack buffers, the
  source-major backward kernel; with ``project``, the sources recomputed
  from the projections' inputs), every launch run eagerly by the
  interpreter, against the jnp path: values and every gradient."""
  ts = kernel_module
  tr = ts.tr
  calls = []

  def counted_launch(kernel, *a, **k):
    calls.append(kernel.__name__)
    return interpreted_launch(kernel, *a, **k)

  monkeypatch.setattr(tr, "_launch", counted_launch)
  monkeypatch.setitem(tr.TUNING, "fwd_given_r", given_r)
  monkeypatch.setitem(ts.SITES_TUNING, "min_sites", 2)
  monkeypatch.setitem(ts.SITES_TUNING, "tokens_per_program", 4)
  d, h = 320, 2
  x0, params, q, g, cot = _stack_problem(3, n, d, h)
  blk = tuple(range(n)) if blocks is None else blocks

  def run(impl):
    plan = stack._Plan(h, 1e-6, impl, blocks=blk, site_group=site_group)
    f = lambda x0, ps, q, g: stack._stack(x0, ps, q, g, None,  # noqa: E731
                                          (_sublayer, project, None), plan)
    with jax.disable_jit():
      out, vjp = jax.vjp(f, x0, params, q, g)
      return out, vjp(cot)

  out_t, grads_t = run("triton")
  groups = stack._Plan(h, 1e-6, "triton", blocks=blk,
                       site_group=site_group).site_groups(n)
  # the full method's groups of min_sites (2 here) sites or more; all of
  # them (a site alone too) when the source buffer is saved
  kept = blocks is None and site_group >= 2 and project is None
  on_tc = (sum(b - a >= (1 if kept else 2) for a, b in groups)
           if blocks is None else 0)
  assert calls.count("sites_kernel") == on_tc, calls
  assert calls.count("sources_kernel") == src_groups, calls
  # one a site, but the first of a group on tensor cores
  assert calls.count("_fwd_kernel") == n + 1 - on_tc, calls
  # full method: one launch a source. Blocks: each block's sites'
  # cotangents a buffer apart, from the sites starting at s_0, at each block
  # sum, and the last: a finished sum, read from the start of one, sums its
  # share of each above it; one launch a partial sum.
  starts = [0] + [j + 1 for j in range(n)
                  if j + 1 == n or blk[j + 1] != blk[j]]
  sources = (n + 1 if blocks is None else len(blk) - len(set(blk))
             + sum(sum(a >= e for a in starts) for e in starts))
  assert calls.count("source_grad_kernel") == sources, calls
  out_r, grads_r = run("reference")
  np.testing.assert_allclose(out_t, out_r, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(grads_t), jax.tree.leaves(grads_r)):
    scale = float(jnp.max(jnp.abs(b)))
    assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * max(scale, 1e-6), scale


def _norm(j, p, x):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p["g"]


def _gain(j, p):
  return p["g"]


_NORM = stack.SublayerRMSNorm(_gain, 1e-6)   # _norm, as the stack takes it


@pytest.mark.parametrize("n,blocks,site_group,below", [
    (5, None, 3, 5),     # groups [0, 2), [2, 5) recomputed; site 5 kept
    (5, None, 0, 5),     # site by site from the list of sources
    (17, None, 16, 17),  # [0, 15) and [15, 17): one site left below site 17
    (5, (0, 0, 1, 1, 1), 0, 5),
    (5, None, 3, 3),     # the lowest sites: [0, 2) and [2, 3) recomputed
    (5, (0, 0, 1, 1, 1), 0, 2),
    (5, None, 3, 0),     # none recomputed: the norms' gradients alone
    (5, (0, 0, 1, 1, 1), 0, 0)])
@pytest.mark.parametrize("norm_kernel", [0, 1, 3])
def test_routed_stack_recomputes_site_outputs(kernel_module, monkeypatch, n,
                                              blocks, site_group, below,
                                              norm_kernel):
  """``routed_stack``'s Triton path with ``norm``: the backward recomputes
  the outputs of the sites below ``below`` (the full method's groups with
  the causal ``sites_kernel`` over the source buffer's rows still holding
  sources; else site by site), every launch run by the interpreter, against
  the jnp path with ``norm`` and without it: values and every gradient.
  ``norm_kernel``: every site's norm gradient by ``norm_grad_kernel``
  (else by autodiff), given the cotangent as 1 term or, where the sublayer
  reads its input three times, 3 (``NORM_TUNING["dy_terms"]``)."""
  ts = kernel_module
  tr = ts.tr
  calls, terms = [], []

  def counted_launch(kernel, *a, **k):
    calls.append((kernel.__name__, k.get("CAUSAL", False)))
    if "NDY" in k:
      terms.append(k["NDY"])
    return interpreted_launch(kernel, *a, **k)

  monkeypatch.setattr(tr, "_launch", counted_launch)
  monkeypatch.setitem(ts.SITES_TUNING, "min_sites", 2)
  monkeypatch.setitem(ts.SITES_TUNING, "tokens_per_program", 4)
  monkeypatch.setitem(ts.NORM_TUNING, "kernel", bool(norm_kernel))
  monkeypatch.setitem(ts.NORM_TUNING, "dy_terms", max(norm_kernel, 1))
  sub = _fanout if norm_kernel == 3 else _sublayer
  d, h = 64, 2
  x0, params, q, g, cot = _stack_problem(n, n, d, h, norm_gains=True)
  blk = tuple(range(n)) if blocks is None else blocks

  def normed(j, p, x, consts):
    return sub(j, p, _norm(j, p, x), consts)

  def run(impl, fns):
    plan = stack._Plan(h, 1e-6, impl, blocks=blk, site_group=site_group,
                       recompute_below=below if fns[2] else None)
    f = lambda x0, ps, q, g: stack._stack(x0, ps, q, g, None, fns,  # noqa: E731
                                          plan)
    with jax.disable_jit():
      out, vjp = jax.vjp(f, x0, params, q, g)
      return out, vjp(cot)

  out_t, grads_t = run("triton", (sub, None, _NORM))
  groups = stack._Plan(h, 1e-6, "triton", blocks=blk,
                       site_group=site_group).site_groups(n)
  full_groups = blocks is None and site_group >= 2
  # recomputed: each group with a site below ``below`` on tensor cores, causal
  causal = sum(a < below for a, _ in groups) if full_groups else 0
  assert calls.count(("sites_kernel", True)) == causal, calls
  assert calls.count(("sites_kernel", False)) == (
      len(groups) if full_groups else 0), calls
  # site by site: once in the forward and once recomputed (below ``below``)
  assert calls.count(("norm_grad_kernel", False)) == n * bool(norm_kernel), \
      calls
  # the kernel adds the cotangent's terms itself: _fanout's three products
  assert terms == [max(norm_kernel, 1)] * n * bool(norm_kernel), terms
  fwd = calls.count(("_fwd_kernel", False))
  assert fwd == (n + 1 - len(groups) if full_groups else n + 1 + below), calls
  for fns in ((sub, None, _NORM), (normed, None, None)):
    out_r, grads_r = run("reference", fns)
    np.testing.assert_allclose(out_t, out_r, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(grads_t), jax.tree.leaves(grads_r)):
      scale = float(jnp.max(jnp.abs(b)))
      assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * max(scale, 1e-6), scale


def _sites_problem(n, d, h, rows, s, g, dtype, causal=False):
  """``(x [rows, n, d]`` in ``dtype``, ``r`` the first ``s`` rows' inverse
  RMS, ``t [g, d]``, ``stack._sites_jnp``'s ``(out, lse)`` of the ``g``
  sites over those rows in fp32)``."""
  rng = np.random.default_rng(n + d + s)
  x = jnp.asarray(rng.normal(size=(rows, n, d)) * 1.3, dtype)
  r = reference.inv_rms(x[:s], 1e-6)
  t = jnp.asarray(0.5 * rng.normal(size=(g, d)) / np.sqrt(d / h), jnp.float32)
  return x, r, t, stack._sites_jnp(x[:s].astype(jnp.float32),
                                   t.reshape(g, h, -1), r, h, causal)


@pytest.mark.parametrize("n,d,h,rows,s,g,bt,sb,causal", [
    (5, 320, 2, 22, 19, 16, 2, 16, False),  # C = 160 = 128 + 32; two blocks
    (3, 64, 4, 7, 7, 5, 4, 16, False),      # C = 16: one part; 5 of 16 rows
    (4, 128, 1, 3, 1, 9, 8, 16, False),     # one source; H = 1; BT > N
    (3, 320, 2, 40, 37, 16, 2, 32, False),  # blocks of 32, the last ragged
    (3, 320, 2, 20, 16, 16, 2, 16, False),  # whole blocks: the unmasked loop
    (2, 64, 4, 40, 32, 9, 4, 16, False),    # ... two of them, C = 16
    (5, 320, 2, 22, 19, 16, 2, 16, True),   # causal: site 0 reads 4 rows
    (3, 64, 4, 40, 32, 9, 4, 16, True),     # ... whole blocks; 9 of 16 rows
    (4, 128, 1, 3, 1, 1, 8, 16, True),      # one site over one row
    (3, 64, 4, 20, 16, 16, 2, 16, True),    # site 0 reads row 0 alone
])
def test_sites_kernel_matches_jnp_sites(kernel_module, n, d, h, rows, s, g,
                                        bt, sb, causal):
  """``sites_kernel`` (G sites over the first S rows of a source buffer, on
  tensor cores; ``causal``: site g over the first S - G + g + 1) against
  ``stack._sites_jnp``; fp32 operands (the interpreter's bf16 products are
  wrong: the GPU tests check those)."""
  ts = kernel_module
  x, r, t, (want, want_lse) = _sites_problem(n, d, h, rows, s, g, jnp.float32,
                                             causal)
  if causal:    # each site as the plain kernel over its own first rows
    for k in range(g):
      one = stack._sites_jnp(x[:s - g + k + 1], t[k:k + 1].reshape(1, h, -1),
                             r[:s - g + k + 1], h)
      np.testing.assert_allclose(want[k], one[0][0], rtol=1e-6, atol=1e-6)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(ts.tr, "_launch", interpreted_launch)
    mp.setitem(ts.SITES_TUNING, "tokens_per_program", bt)
    mp.setitem(ts.SITES_TUNING, "source_block", sb)
    out, lse = ts.sites_local(x, r, s, t, h, causal)
  assert out.shape == (g, n, d) and lse.shape == (g, n, h)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,s,g,out_row", [(22, 5, 16, 6), (40, 19, 9, 31)])
def test_sites_kernel_into_rows(kernel_module, monkeypatch, rows, s, g,
                                out_row):
  """``sites_local(out_row=...)``: the G results written into rows
  ``out_row ..`` of the source buffer itself (the others kept) and of an
  ``[R, N, H]`` lse; out_row before s or past R - G refused."""
  ts = kernel_module
  n, d, h = 3, 320, 2
  x, r, t, (want, want_lse) = _sites_problem(n, d, h, rows, s, g, jnp.float32)
  monkeypatch.setattr(ts.tr, "_launch", interpreted_launch)
  monkeypatch.setitem(ts.SITES_TUNING, "tokens_per_program", 2)
  out, lse = ts.sites_local(x, r, s, t, h, out_row=out_row)
  assert out.shape == x.shape and lse.shape == (rows, n, h)
  got = slice(out_row, out_row + g)
  np.testing.assert_allclose(out[got], want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lse[got], want_lse, rtol=1e-5, atol=1e-5)
  kept = np.ones(rows, bool)
  kept[got] = False
  np.testing.assert_array_equal(out[kept], x[kept])
  for bad in (s - 1, rows - g + 1):
    with pytest.raises(ValueError, match="out_row"):
      ts.sites_local(x, r, s, t, h, out_row=bad)


@pytest.mark.parametrize("split_weights", [False, True])
def test_sites_kernel_16bit_launch(kernel_module, monkeypatch, split_weights):
  """``sites_kernel`` launched for bf16 sources (the LOWP path: queries as
  two terms, the weights as one or, ``split_weights``, two): indexing and
  math against ``stack._sites_jnp`` on the same values in fp32, to the bf16
  output's rounding (the interpreter multiplies in fp32, so the terms'
  rounding itself is the GPU tests')."""
  ts = kernel_module
  n, d, h, rows, s, g = 5, 320, 2, 22, 19, 16
  x, r, t, (want, want_lse) = _sites_problem(n, d, h, rows, s, g,
                                             jnp.bfloat16)
  monkeypatch.setattr(ts.tr, "_launch", interpreted_launch)
  monkeypatch.setitem(ts.SITES_TUNING, "tokens_per_program", 2)
  monkeypatch.setitem(ts.SITES_TUNING, "split_weights", split_weights)
  out, lse = ts.sites_local(x, r, s, t, h)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), want,
                             rtol=1e-2, atol=1e-2)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_sites_supported(kernel_module):
  ok = kernel_module.sites_supported
  assert ok(1280, 8, 16) and ok(1024, 8, 9)
  assert not ok(576, 8, 16)      # C = 72 = 64 + 8: 8 lanes
  assert ok(1280, 8, 1)          # one row: a depth's last group of sources
  assert not ok(1280, 8, 0) and not ok(1280, 8, 65)


@pytest.mark.parametrize("project,blocks,site_block,norm", [
    (None, None, 16, None), (_project, None, 16, None),
    (_project, None, 4, None), (None, (0, 0, 0, 1, 1, 2, 2, 2, 2), 16, None),
    (None, None, 16, _NORM)])
def test_sharded_group_plumbing(kernel_module, monkeypatch, project, blocks,
                                site_block, norm):
  """``routed_stack``'s Triton path with groups of sites and of sources under
  a (data=4, model=2) mesh of CPU devices: every kernel wrapper's shard_map
  specs, reshapes and ``dt`` psums, with the local kernels replaced by the
  jnp functions they compute (rows of buffers passed in place where the
  sources are saved), against the jnp path without a mesh (with
  ``project``: the backward's groups of recomputed sources; with
  ``blocks``: block sums summing their shares over each block's span of
  cotangents; ``site_block`` 4: a group's share of the spans above it in
  one launch; with ``norm``: the groups' outputs recomputed, causal, and
  every norm's gradient by ``norm_grad``)."""
  from mhar_jax.parallel import make_mesh
  ts = kernel_module
  tr = ts.tr
  n, d, h = 9, 64, 2      # C = 32: the tensor-core kernels take it

  calls = []

  def sites_local(x, r, s, t, heads, causal=False, out_row=None):
    calls.append("causal" if causal else "sites")
    calls.append(("out_row", out_row))
    out, lse = stack._sites_jnp(x[:s], t.reshape(t.shape[0], h, -1), r, h,
                                causal)
    if out_row is None:
      return out, lse
    assert s <= out_row <= x.shape[0] - t.shape[0], (s, out_row, x.shape)
    # the rows not written: NaN, as unwritten kernel outputs are poisoned
    lse_rows = jnp.full((x.shape[0], *lse.shape[1:]), jnp.nan, lse.dtype)
    return (x.at[out_row:out_row + t.shape[0]].set(out),
            lse_rows.at[out_row:out_row + t.shape[0]].set(lse))

  def sources_partial_local(S, i0, gv, r, dX, t, lse, xd, j, m, heads,
                            init=None, dx_row=None, into=None):
    calls.append("sources")
    buf = into if into is not None else (
        init[0] if init is not None and init[0].shape[0] != gv else None)
    if buf is not None:     # the share in the first rows of a bigger buffer
      calls.append(("into", buf.shape[0] - gv))
      init = None if init is None else (init[0][:gv], init[1])
    pieces = ts.cotangent_pieces(dX, m, j if dx_row is None else dx_row)
    calls.append(("pieces", len(pieces)))
    dts = []
    for dx, row, k in pieces:        # the pieces' shares in turn
      init = stack.sources_partial(S[i0:i0 + gv], r, dx, t, lse, xd, j, k, h,
                                   init, row)
      j, dts = j + k, dts + [init[2]]
      init = init[:2]
    acc, coef = init
    return (acc if buf is None else buf.at[:gv].set(acc)), coef, \
        jnp.concatenate(dts)

  def source_grad_local(s, r, dX, t, lse, xd, i, heads, m=None, init=None,
                        dx_row=None, partial=False, s_row=None,
                        init_row=None):
    if partial:
      calls.append("source")
    calls.append(("rows", s_row is not None, init_row is not None))
    s = s if s_row is None else s[s_row]
    init = init if init_row is None else tuple(x[init_row] for x in init)
    return stack.source_grad(s, r, dX, t, lse, xd, i, h, m, init, dx_row,
                             partial)

  def rows_buffer_local(rows, like, dtype, tag):  # unwritten rows: NaN
    return jnp.full((rows, *like.shape), jnp.nan, dtype)

  def norm_grad_local(x, scale, dy, eps, heads, buf, row, x_row=None):
    calls.append("norm")
    calls.append(("x_row", x_row))
    calls.append(("terms", len(dy)))     # the sublayer's three uses of x
    dy = sum(dy)
    x = x if x_row is None else x[x_row]
    _, vjp = jax.vjp(lambda x, s: reference.rms_norm(x, s, eps), x, scale)
    dx, dscale = vjp(dy)
    return buf.at[row].set(dx), stack.dot_heads(dx, x, heads), dscale

  monkeypatch.setattr(tr, "_fwd_local", jnp_fwd_local(h, 1e-6))
  monkeypatch.setattr(ts, "rows_buffer_local", rows_buffer_local)
  monkeypatch.setattr(ts, "sites_local", sites_local)
  monkeypatch.setattr(ts, "sources_partial_local", sources_partial_local)
  monkeypatch.setattr(ts, "source_grad_local", source_grad_local)
  monkeypatch.setattr(ts, "norm_grad_local", norm_grad_local)
  monkeypatch.setitem(ts.NORM_TUNING, "kernel", True)
  monkeypatch.setitem(ts.NORM_TUNING, "dy_terms", 3)
  monkeypatch.setitem(ts.SITES_TUNING, "min_sites", 2)
  monkeypatch.setitem(ts.SOURCES_TUNING, "site_block", site_block)
  monkeypatch.setitem(ts.SOURCES_TUNING, "max_buffers", 4)
  rng = np.random.default_rng(5)
  x0 = jnp.asarray(rng.normal(size=(8, 3, d)), jnp.float32)
  params = tuple({"w": jnp.asarray(rng.normal(size=(d, d)) / 8, jnp.float32),
                  "b": jnp.asarray(0.1 * rng.normal(size=d), jnp.float32),
                  "g": jnp.asarray(1 + 0.3 * rng.normal(size=d), jnp.float32)}
                 for _ in range(n))
  q = jnp.asarray(0.5 * rng.normal(size=(n + 1, d)), jnp.float32)
  g = jnp.asarray(1 + 0.2 * rng.normal(size=(n + 1, d)), jnp.float32)
  mesh = make_mesh(4, 2, jax.devices()[:8])

  def run(plan):
    fns = (_fanout if norm else _sublayer, project, norm)
    f = lambda *a: jnp.sum(stack._stack(*a, None, fns, plan) ** 2)  # noqa: E731
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(
        x0, params, q, g)

  blk = tuple(range(n)) if blocks is None else blocks
  got = run(stack._Plan(h, 1e-6, "triton", blocks=blk, site_group=4,
                        mesh=mesh, batch_axes=("data",)))
  partials = calls.count("source")
  rows = [c[1:] for c in calls if c[0] == "rows"]
  into = [c[1] for c in calls if c[0] == "into"]
  pieces = [c[1] for c in calls if c[0] == "pieces"]
  # with norm, every site's norm gradient by its kernel, under the mesh;
  # the recomputed sites' inputs read as rows of their group's outputs
  assert calls.count("norm") == (n if norm else 0), calls
  x_rows = [c[1] for c in calls if c[0] == "x_row"]
  assert len(x_rows) == calls.count("norm")
  assert [c[1] for c in calls if c[0] == "terms"] == [3] * len(x_rows)
  if norm:   # sites 8 .. 0 of the recomputed groups [7, 9), [3, 7), [0, 3)
    assert x_rows == [1, 0, 3, 2, 1, 0, 2, 1, 0], x_rows
  # the forward's groups (0, 3), (3, 7), (7, 10) write their first phase
  # into the saved buffer's rows 1 .., 4 .., 8 .. (sources not yet made);
  # recomputed sources keep no buffer: their own arrays
  out_rows = [c[1] for c in calls if c[0] == "out_row"]
  if blocks is None:
    assert out_rows == ([None] * 3 if project else [1, 4, 8]) + [None] * (
        3 if norm else 0), out_rows
  calls = [c for c in calls if c not in ("source", "norm") and c[0] not in
           ("rows", "into", "pieces", "x_row", "out_row", "terms")]
  merged = bool(project) and site_block == 4
  if blocks is None:
    # forward groups (0, 3), (3, 7), (7, 10); backward groups [2, 6), [0, 2)
    # under [6, 10); recomputed sources: each group's cotangents apart, so
    # [0, 2) takes its share of [2, 6) and [6, 10) in two calls, or in one
    # reading both buffers where [6, 10) starts a whole site block later
    assert [c for c in calls if c != "causal"] == (
        ["sites"] * 3 + ["sources"] * (2 + bool(project) - merged)), calls
    # with norm, the backward recomputes the groups [7, 9), [3, 7), [0, 3)
    assert calls.count("causal") == (3 if norm else 0), calls
    assert pieces == ([1, 2] if merged else [1] * len(pieces)), pieces
    assert partials == 0
    # the saved sources' buffer: every source a row of it, and every share
    # of a group below the top a row of that group's sums (sources 0 .. 5);
    # recomputed, the top group's sources are arrays and the others rows of
    # their group's stack (the one the share was computed from)
    assert rows == [(bool(not project), False)] * 4 + [(True, True)] * 6, rows
    # recomputed: each group below the top takes its share into its
    # cotangent buffer, one row more than the group ([2, 6) once; [0, 2)
    # in two calls, the second continuing the first)
    assert into == ([1, 1] if merged else [1, 1, 1] if project else []), \
        into
  else:   # spans of sites [0, 3), [3, 5), [5, 9), [9]: s_0 continues 3
    assert calls == [] and partials == 3 + 2 + 1, calls
  want = run(stack._Plan(h, 1e-6, "reference", blocks=blk))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=2e-5,
                               atol=2e-5 * float(jnp.abs(b).max()))


@pytest.mark.parametrize("impl,d,h,blocks,site_group,want", [
    ("triton", 64, 4, None, None, 16),      # full method, C = 16: on tensor cores
    ("triton", 64, 4, (0, 0, 1), None, 0),  # blocked: each site alone
    ("triton", 72, 8, None, None, 0),       # C = 9: too narrow for tl.dot
    ("reference", 64, 4, None, None, 0),    # jnp: each site alone
    ("triton", 64, 4, None, 0, 0), ("reference", 64, 4, None, 5, 5)])
def test_automatic_site_group(kernel_module, monkeypatch, impl, d, h, blocks,
                              site_group, want):
  """``routed_stack(site_group=None)`` groups 16 sites where the groups route
  on tensor cores and none elsewhere; a given value is kept."""
  plans = []
  monkeypatch.setattr(stack, "_stack",
                      lambda *a: plans.append(a[-1]) or a[0])
  monkeypatch.setattr(kernel_module.tr, "sharding_plan", lambda x: (None, ()))
  import mhar_jax.kernels
  monkeypatch.setattr(mhar_jax.kernels, "resolve_impl", lambda i: i)
  x = jnp.zeros((2, d))
  stack.routed_stack(x, [None] * 3, _sublayer, jnp.zeros((4, d)),
                     jnp.ones((4, d)), num_heads=h, impl=impl, blocks=blocks,
                     site_group=site_group)
  assert plans[0].site_group == want
