"""The routing kernels (kernels/triton_route.py) under Triton's interpreter.

Runs on CPU where ``triton`` and ``torch`` are installed (``TRITON_INTERPRET=1``
executes the kernels in numpy); skipped elsewhere. Launches the forward,
c-pass and backward kernels directly, the way ``triton_route`` chains them
(two launches carrying the online-softmax state, then the backward), on
NaN-filled outputs, and checks every output against the jnp reference: the
tiles' indexing (both parts of a head, token tails, padded heads) and math.
tests/test_triton_route.py checks the real GPU build through jax-triton.
"""


import numpy as np
import pytest

import jax
import jax.numpy as jnp

if jax.default_backend() == "gpu":   # there tests/test_triton_route.py runs
  pytest.skip("interpreter test: CPU only", allow_module_level=True)
from helpers import (interpreted_kernels, interpreted_launch,  # noqa: E402
                     jnp_fwd_local, use_triton_interpreter)
from helpers import to_torch as _T  # noqa: E402

torch = pytest.importorskip("torch")
use_triton_interpreter()
triton = pytest.importorskip("triton")

from mhar_jax.kernels import reference  # noqa: E402

EPS = 1e-6


@pytest.fixture(scope="module")
def tr():
  yield from interpreted_kernels("mhar_jax.kernels.triton_route")


def _nan(*shape):
  return torch.full(shape, float("nan"))


def _close(got, want, tol=1e-5):
  got = got.numpy() if hasattr(got, "numpy") else np.asarray(got)
  want = np.asarray(want, np.float64)
  assert np.isfinite(got).all(), "unwritten (NaN) output elements"
  err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
  assert err <= tol, err


def _slots(tr, xs):
  return list(xs) + [xs[0]] * (tr.MAX_SOURCES_PER_LAUNCH - len(xs))


def _forward(tr, launches, t, n_tok, d, h, pf, init=None, i0=0,
             given_r=False, r_out=None):
  """Runs the forward kernel for the G sites of ``t`` (``[G, D]``) over the
  source lists ``launches`` (the first continuing rows ``i0 ..`` of
  ``init = (out, lse)`` when given, the others carrying (m, l, acc); with
  ``given_r`` each source's inverse RMS is passed in; with ``r_out`` (a list)
  the kernel writes them, one ``[NSRC, N]`` array a launch appended);
  returns ``(out, lse)``."""
  g = t.shape[0]
  meta = dict(tr.tile_meta(d, h), EPS=EPS)
  bn = tr._tokens_per_program(tr.tile_width(d, h), 16, 4)
  grid = (g * triton.cdiv(n_tok, bn),)
  dummy = torch.zeros(1)
  out, lse = _nan(g, n_tok, d), _nan(g, n_tok, h)
  state, mode = (t, t, t), 0
  if init is not None:
    state, mode = (init[1], t, init[0]), 2
  for li, ch in enumerate(launches):
    last = li == len(launches) - 1
    rw = dummy if r_out is None else _nan(len(ch), n_tok)
    outs = ((out, lse, dummy, dummy, dummy, rw) if last else
            (dummy, dummy, _nan(g, n_tok, h), _nan(g, n_tok, h),
             _nan(g, n_tok, d), rw))
    rs = ([_T(reference.inv_rms(jnp.asarray(x.numpy()), EPS)) for x in ch]
          if given_r else ch)
    tr._fwd_kernel[grid](*_slots(tr, ch), *_slots(tr, rs), t, *state,
                         *([dummy] * 6), n_tok, i0, *outs, NSRC=len(ch),
                         INIT=mode, LAST=last, HAS_R=given_r,
                         WRITE_R=r_out is not None, G=g,
                         PF=pf, PIN=False, BN=bn, **meta)
    if r_out is not None:
      r_out.append(rw)
    state, mode = outs[2:5], 1
  return out, lse


@pytest.mark.parametrize("n_tok,d,h,nsrc,split,pf", [
    (13, 320, 2, 5, 2, 2),     # C = 160 = 128 + 32: two parts, as at 1b
    (9, 96, 1, 3, 1, 4),       # C = 96 = 64 + 32, one head (AttnRes)
    (11, 56, 4, 4, 3, 1),      # C = 14 = 8 + 8 (part b masked at 6)
    (7, 48, 16, 2, 1, 3),      # C = 3 = 2 + 2, H = 16
    (10, 64, 4, 6, 4, 4),      # C = 16: one part only
    (5, 40, 8, 1, 0, 1),       # one source, one launch; C = 5
])
def test_kernels_match_reference(tr, n_tok, d, h, nsrc, split, pf):
  rng = np.random.default_rng(7 * n_tok + d + nsrc)
  srcs = [(rng.normal(size=(n_tok, d)) * (0.5 + 0.6 * i) + 0.2 * i)
          .astype(np.float32) for i in range(nsrc)]
  query = (0.4 * rng.normal(size=d)).astype(np.float32)
  scale = (1 + 0.3 * rng.normal(size=d)).astype(np.float32)
  g = rng.normal(size=(n_tok, d)).astype(np.float32)
  t = query * scale
  meta = dict(tr.tile_meta(d, h), EPS=EPS)
  bn = tr._tokens_per_program(tr.tile_width(d, h), 16, 4)
  grid = (triton.cdiv(n_tok, bn),)
  k = tr.MAX_SOURCES_PER_LAUNCH
  T = [_T(s) for s in srcs]
  tt = _T(t)
  dummy = torch.zeros(1)

  # forward: sources [0, split) then [split, nsrc), carrying (m, l, acc);
  # it also writes each source's inverse RMS (route()'s forward does)
  launches = [T[:split], T[split:]] if split else [T]
  r_out = []
  out, lse = (x[0] for x in _forward(tr, launches, tt[None], n_tok, d, h, pf,
                                     r_out=r_out))
  sj = [jnp.asarray(s) for s in srcs]
  out_ref, vjp = jax.vjp(
      lambda ss, q: reference.route(ss, q, jnp.asarray(scale), num_heads=h,
                                    eps=EPS), sj, jnp.asarray(query))
  _close(out, out_ref)
  st = jnp.stack(sj)                                        # [S, N, D]
  logits = (reference.inv_rms(st, EPS)[..., None]
            * jnp.einsum("snhc,hc->snh", st.reshape(nsrc, n_tok, h, -1),
                         jnp.asarray(t).reshape(h, -1)))
  lse_ref = jax.nn.logsumexp(logits, axis=0)
  _close(lse, lse_ref)
  r_ref = reference.inv_rms(st, EPS)
  _close(torch.cat(r_out), r_ref)
  # the same with each source's inverse RMS passed in (routed_stack's call)
  out_r, lse_r = (x[0] for x in _forward(tr, launches, tt[None], n_tok, d, h,
                                         pf, given_r=True))
  _close(out_r, out_ref)
  _close(lse_r, lse_ref)

  # the backward, with the inverse RMS computed and given
  w = jnp.exp(logits - lse_ref)
  c_ref = jnp.sum(w * jnp.einsum("snhc,nhc->snh",
                                 st.reshape(nsrc, n_tok, h, -1),
                                 jnp.asarray(g).reshape(n_tok, h, -1)), 0)
  ds_ref, dquery_ref = vjp(jnp.asarray(g))
  gT = _T(g)
  R = list(torch.cat(r_out))
  for given_r in (False, True):
    # pass 1: c = sum_i w_i <g, s_i>_h, chained over the same launches
    c, i = None, 0
    for li, ch in enumerate(launches):
      first = li == 0
      c_new = c if not first else _nan(n_tok, h)
      rs = R[i:i + len(ch)] if given_r else ch
      i += len(ch)
      tr._cpass_kernel[grid](*_slots(tr, ch), *_slots(tr, rs), gT, tt, lse,
                             tt if first else c, dummy, n_tok, c_new,
                             NSRC=len(ch), FIRST=first, PF=pf, PIN=False,
                             HAS_R=given_r, BN=bn, **meta)
      c = c_new
    _close(c, c_ref)

    # pass 2: every ds_i and the per-program partial sums of dt
    ntiles = grid[0]
    progs = min(ntiles, 3)           # persistent programs looping over tiles
    ds = [_nan(n_tok, d) for _ in range(nsrc)]
    dt = _nan(progs, d)
    tr._bwd_kernel[(progs,)](*_slots(tr, T), *_slots(tr, R if given_r else T),
                             gT, tt, lse, c, *([dummy] * k), dummy, n_tok,
                             ntiles, *_slots(tr, ds), dt, NSRC=nsrc, PF=pf,
                             HAS_R=given_r, BN=bn, **meta)
    for got, want in zip(ds, ds_ref):
      _close(got, want)
    _close(dt.sum(0) * _T(scale), dquery_ref)


def test_head_parts(tr):
  assert tr.head_parts(160) == (128, 32)
  assert tr.head_parts(96) == (64, 32)
  assert tr.head_parts(112) == (64, 64)
  assert tr.head_parts(128) == (128, 0)
  assert tr.head_parts(1) == (1, 0)
  assert tr.tile_width(1280, 8) == 1280
  assert tr.tile_width(1280, 16) == 16 * (64 + 16)


@pytest.mark.parametrize("n_tok,d,h,sites,old,new", [
    (9, 320, 2, 3, 3, 2),      # C = 160, two parts
    (6, 56, 4, 4, 17, 5),      # old sources over two launches (16 + 1)
    (5, 40, 8, 1, 2, 1),
])
def test_forward_sites_and_continuation(tr, n_tok, d, h, sites, old, new):
  """Routing G sites in one launch, then continuing each from its (out, lse)
  over more sources, equals routing each site over all its sources."""
  rng = np.random.default_rng(n_tok * d + sites)
  srcs = [(rng.normal(size=(n_tok, d)) * (0.5 + 0.3 * i) + 0.1 * i)
          .astype(np.float32) for i in range(old + new)]
  t = (0.5 * rng.normal(size=(sites, d))).astype(np.float32)
  T = [_T(x) for x in srcs]
  k = tr.MAX_SOURCES_PER_LAUNCH
  first = _forward(tr, [T[i:min(i + k, old)] for i in range(0, old, k)],
                   _T(t), n_tok, d, h, pf=2)
  out, lse = _forward(tr, [T[old:]], _T(t), n_tok, d, h, pf=1, init=first,
                      given_r=True)
  ones = jnp.ones((d,))
  for j in range(sites):
    want = reference.route([jnp.asarray(x) for x in srcs], jnp.asarray(t[j]),
                           ones, num_heads=h, eps=EPS)
    _close(out[j], want)
    # one site continuing row j of the group's results
    one, _ = _forward(tr, [T[old:]], _T(t[j:j + 1]), n_tok, d, h, pf=1,
                      init=first, i0=j)
    _close(one[0], want)
    part = reference.route([jnp.asarray(x) for x in srcs[:old]],
                           jnp.asarray(t[j]), ones, num_heads=h, eps=EPS)
    _close(first[0][j], part)


def test_sharded_two_phase_plumbing(tr, monkeypatch):
  """``_fwd_impl`` under a (data=4, model=2) mesh of CPU devices, for G sites
  continuing rows of an earlier result: the shard_map specs, reshapes and
  row offset, with ``_fwd_local`` replaced by the jnp two-phase routing
  (kernels.stack) that the kernels compute."""
  from mhar_jax.parallel import make_mesh
  h, d = 2, 16
  monkeypatch.setattr(tr, "_fwd_local", jnp_fwd_local(h, EPS))
  mesh = make_mesh(4, 2, jax.devices()[:8])
  rng = np.random.default_rng(3)
  srcs = [jnp.asarray(rng.normal(size=(8, 3, d)), jnp.float32)
          for _ in range(5)]
  t = jnp.asarray(rng.normal(size=(3, d)), jnp.float32)
  cfg = tr._make_cfg(d, h, EPS, True, mesh, ("data",))
  first = jax.jit(lambda s, t: tr._fwd_impl(s, t, cfg))(srcs[:3], t)
  assert first[0].shape == (3, 8, 3, d) and first[1].shape == (3, 8, 3, h)
  rs = [reference.inv_rms(s, EPS) for s in srcs[3:]]
  out, lse = jax.jit(lambda s, t, f, rs: tr._fwd_impl(
      s, t, cfg, init=(*f, 1), rs=rs))(srcs[3:], t[1:], first, rs)
  assert out.shape == (2, 8, 3, d) and lse.shape == (2, 8, 3, h)
  for g in (1, 2):
    want = reference.route(srcs, t[g], jnp.ones((d,)), num_heads=h, eps=EPS)
    _close(np.asarray(out[g - 1]), want)


def test_given_inverse_rms_drops_the_cross_warp_reduction(tmp_path):
  """Compiled for sm_90 (no GPU needed; tools/kernel_resources.py, in its own
  process: this one runs Triton's interpreter), the forward and the c-pass
  that read each source's inverse RMS need fewer barriers and no more
  registers than those that sum squares across warps; ``--opcodes`` lists
  the loop body's most frequent opcodes."""
  import json
  import os
  import pathlib
  import subprocess
  import sys
  root = pathlib.Path(__file__).resolve().parent.parent
  env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
  res = subprocess.run(
      [sys.executable, str(root / "tools" / "kernel_resources.py"), "--nsrc",
       "4", "--kernels", "fwd,fwd_r,cpass,cpass_r,source_grad", "--opcodes",
       "3"], capture_output=True, text=True, env=env, cwd=tmp_path,
      timeout=600)
  if res.returncode and "ptxas" in res.stderr:
    pytest.skip("this Triton cannot compile for sm_90 here")
  assert res.returncode == 0, res.stderr[-2000:]
  rows = {r["kernel"]: r for r in map(json.loads, [
      line for line in res.stdout.splitlines() if line.startswith("{")])}
  for k in ("fwd", "cpass"):
    assert rows[k + "_r"]["barriers"] < rows[k]["barriers"], rows
    assert rows[k + "_r"]["regs"] <= rows[k]["regs"], rows
  for row in rows.values():       # --opcodes: a histogram of the loop body
    ops = row["loop_opcodes"]     # (empty where every loop is unrolled)
    assert sum(ops.values()) <= row["loop_sass"], row
    assert len(ops) == (3 if row["loop_sass"] else 0), row
  assert rows["source_grad"]["loop_sass"] > 0, rows     # its loop over sites


def test_every_kernel_compiles_with_runtime_ints_of_one(tmp_path):
  """Compiled for sm_90 with every runtime int argument equal to 1, which
  Triton specialises to a constexpr on the GPU (``N.to(...)`` on such an
  argument fails only then, e.g. one token a shard or the site index 1);
  the query-gain product in both layouts of ``dlr``."""
  import os
  import pathlib
  import subprocess
  import sys
  root = pathlib.Path(__file__).resolve().parent.parent
  env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
  res = subprocess.run(
      [sys.executable, str(root / "tools" / "kernel_resources.py"), "--nsrc",
       "2", "--ones", "--kernels", "fwd,fwd_r,cpass,cpass_r,bwd,bwd_r,"
       "source_grad,source_grad_init,sites,sources,query_gain_grad"],
      capture_output=True,
      text=True, env=env, cwd=tmp_path, timeout=900)
  if res.returncode and "ptxas" in res.stderr:
    pytest.skip("this Triton cannot compile for sm_90 here")
  assert res.returncode == 0, res.stderr[-2000:]
  assert res.stdout.count('"regs"') == 11, res.stdout
  res = subprocess.run(
      [sys.executable, str(root / "tools" / "kernel_resources.py"), "--ones",
       "--kernels", "query_gain_grad", "--qgrad_sites", "40", "--qgrad_unit",
       "2"], capture_output=True, text=True, env=env,
      cwd=tmp_path, timeout=900)
  assert res.returncode == 0, res.stderr[-2000:]
  assert res.stdout.count('"regs"') == 1, res.stdout


@pytest.mark.parametrize("given_r", [False, True])
def test_fwd_local_launch_plumbing(tr, monkeypatch, given_r):
  """``_fwd_local`` itself (argument order, the inverse-RMS slots, the carry
  aliases between launches of 16 sources, a continuation), its launches run
  by the interpreter: 2 sites over 35 sources (three launches, the middle one
  carrying its state in place), then one continued over 2 more, against the
  reference."""
  monkeypatch.setattr(tr, "_launch", interpreted_launch)
  n_tok, d, h = 5, 320, 2
  rng = np.random.default_rng(11)
  srcs = [jnp.asarray((rng.normal(size=(n_tok, d)) * (0.5 + 0.1 * i)),
                      jnp.float32) for i in range(37)]
  t = jnp.asarray(0.5 * rng.normal(size=(2, d)), jnp.float32)
  cfg = tr._make_cfg(d, h, EPS, True, None, ())
  rs = [reference.inv_rms(s, EPS) for s in srcs]
  pick = lambda a, b: tuple(rs[a:b]) if given_r else None  # noqa: E731
  out, lse = tr._fwd_local(tuple(srcs[:35]), t, cfg, rs=pick(0, 35))
  out2, _ = tr._fwd_local(tuple(srcs[35:]), t[1:], cfg, init=(out, lse, 1),
                          rs=pick(35, 37))
  ones = jnp.ones((d,))
  for g in range(2):
    want = reference.route(srcs[:35], t[g], ones, num_heads=h, eps=EPS)
    _close(np.asarray(out[g]), want)
  want = reference.route(srcs, t[1], ones, num_heads=h, eps=EPS)
  _close(np.asarray(out2[0]), want)


@pytest.mark.parametrize("given_r", [False, True])
def test_route_launch_plumbing(tr, monkeypatch, given_r):
  """route()'s kernel calls on 19 sources (two launches each), run by the
  interpreter: the forward writing each source's inverse RMS (``write_r``),
  then the c-pass (its carry alias) and the backward with and without them,
  against the reference's values and gradients."""
  monkeypatch.setattr(tr, "_launch", interpreted_launch)
  n_tok, d, h, s = 6, 320, 2, 19
  rng = np.random.default_rng(5)
  srcs = tuple(jnp.asarray(rng.normal(size=(n_tok, d)) * (0.5 + 0.1 * i),
                           jnp.float32) for i in range(s))
  query = jnp.asarray(0.5 * rng.normal(size=d), jnp.float32)
  g = jnp.asarray(rng.normal(size=(n_tok, d)), jnp.float32)
  cfg = tr._make_cfg(d, h, EPS, True, None, ())
  out, lse, r = tr._fwd_local(srcs, query[None], cfg, write_r=True)
  ones = jnp.ones((d,))
  want, vjp = jax.vjp(lambda ss, q: reference.route(
      list(ss), q, ones, num_heads=h, eps=EPS), srcs, query)
  _close(np.asarray(out[0]), want)
  _close(np.asarray(r), reference.inv_rms(jnp.stack(srcs), EPS))
  rs = tuple(r) if given_r else None
  c = tr._cpass_local(srcs, g, query, lse[0], cfg, rs)
  ds, dt = tr._bwd_local(srcs, g, query, lse[0], c, cfg, rs)
  ds_ref, dq_ref = vjp(g)
  for got, ref in zip(ds, ds_ref):
    _close(np.asarray(got), ref)
  _close(np.asarray(dt), dq_ref)


def test_sharded_route_backward_plumbing(tr, monkeypatch):
  """``_fwd_impl(write_r=True)`` and ``_bwd_impl(rs=...)`` under a
  (data=4, model=2) mesh of CPU devices: the inverse RMS ``[S, tokens...]``
  leave the forward and reach the backward's kernels sharded like the
  tokens (the kernels replaced by jnp stand-ins that check what they get)."""
  from mhar_jax.parallel import make_mesh
  h, d, s = 2, 16, 3

  def fwd_local(srcs, t, cfg, init=None, rs=None, write_r=False):
    assert write_r and init is None and rs is None
    out = reference.route(list(srcs), t[0], jnp.ones((d,)), num_heads=h,
                          eps=EPS)
    st = jnp.stack(srcs)
    logit = reference.inv_rms(st, EPS)[..., None] * jnp.einsum(
        "snhc,hc->snh", st.reshape(s, -1, h, d // h), t.reshape(h, -1))
    return (out[None], jax.nn.logsumexp(logit, 0)[None],
            reference.inv_rms(st, EPS))

  seen = []

  def cpass_local(srcs, g, t, lse, cfg, rs=None):
    seen.append([x.shape for x in rs])
    return jnp.zeros(lse.shape)

  def bwd_local(srcs, g, t, lse, c, cfg, rs=None):
    seen.append([x.shape for x in rs])     # ds_i = the r_i it was given
    return (tuple(jnp.broadcast_to(r[:, None], x.shape)
                  for r, x in zip(rs, srcs)), jnp.zeros((d,)))

  monkeypatch.setattr(tr, "_fwd_local", fwd_local)
  monkeypatch.setattr(tr, "_cpass_local", cpass_local)
  monkeypatch.setattr(tr, "_bwd_local", bwd_local)
  mesh = make_mesh(4, 2, jax.devices()[:8])
  rng = np.random.default_rng(4)
  srcs = [jnp.asarray(rng.normal(size=(8, 3, d)), jnp.float32)
          for _ in range(s)]
  t = jnp.asarray(rng.normal(size=(1, d)), jnp.float32)
  cfg = tr._make_cfg(d, h, EPS, True, mesh, ("data",))
  out, lse, r = jax.jit(lambda s, t: tr._fwd_impl(s, t, cfg, write_r=True))(
      srcs, t)
  assert out.shape == (1, 8, 3, d) and lse.shape == (1, 8, 3, h)
  assert r.shape == (s, 8, 3)
  _close(np.asarray(r), reference.inv_rms(jnp.stack(srcs), EPS))
  ds, _ = jax.jit(lambda s, g, t, lse, r: tr._bwd_impl(s, g, t, lse, None,
                                                        cfg, r))(
      srcs, srcs[0], t[0], lse[0], r)
  assert seen == [[(6,)] * s] * 2     # 2 x 3 tokens a shard of the data axis
  for x, src in zip(ds, srcs):
    _close(np.asarray(x[..., 0]), reference.inv_rms(src, EPS))


@pytest.mark.parametrize("given_r", [False, True])
def test_route_custom_vjp_end_to_end(tr, monkeypatch, given_r):
  """``route()``'s custom VJP (forward residuals, the inverse RMS passed to
  the backward's kernels when ``bwd_given_r``) on 18 sources, every launch
  run by the interpreter (eagerly: the launches need concrete arrays),
  against the reference's values and gradients."""
  seen = []

  def launch(kernel, *a, **k):
    seen.append((kernel.__name__, k.get("HAS_R")))
    return interpreted_launch(kernel, *a, **k)

  monkeypatch.setattr(tr, "_launch", launch)
  monkeypatch.setitem(tr.TUNING, "bwd_given_r", given_r)
  n_tok, d, h, s = 4, 320, 2, 18
  rng = np.random.default_rng(9)
  srcs = [jnp.asarray(rng.normal(size=(n_tok, d)) * (0.6 + 0.1 * i),
                      jnp.float32) for i in range(s)]
  query = jnp.asarray(0.5 * rng.normal(size=d), jnp.float32)
  scale = jnp.asarray(1 + 0.2 * rng.normal(size=d), jnp.float32)
  g = jnp.asarray(rng.normal(size=(n_tok, d)), jnp.float32)
  cfg = tr._make_cfg(d, h, EPS, True, None, ())
  with jax.disable_jit():
    out, vjp = jax.vjp(lambda ss, q, k: tr._route(tuple(ss), q, k, cfg),
                       srcs, query, scale)
    grads = vjp(g)
  want, vjp_ref = jax.vjp(lambda ss, q, k: reference.route(
      ss, q, k, num_heads=h, eps=EPS), srcs, query, scale)
  _close(np.asarray(out), want)
  for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(vjp_ref(g))):
    _close(np.asarray(got), ref)
  has_r = {k: {r for name, r in seen if name == k}
           for k in ("_cpass_kernel", "_bwd_kernel")}
  assert has_r == {"_cpass_kernel": {given_r},
                   "_bwd_kernel": {given_r}}, has_r
