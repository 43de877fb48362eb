"""GPU tests: the Triton routing kernels against the pure-jnp reference.

Skipped (at collection) unless JAX's default backend is a GPU and jax_triton
imports; ``mhar_jax.kernels.triton_route`` (which imports jax_triton) is only
imported after that check. On the device machine run with
``JAX_PLATFORMS=cuda`` (tests/conftest.py defaults JAX to the CPU).

Every kernel call is traced with poisoned outputs (NaN-filled buffers aliased
to the kernel outputs), so an element a kernel fails to write is a NaN and
fails the comparison. Inputs are fresh random draws with non-trivial scale and
offset per source, random query and gain.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

if jax.default_backend() != "gpu":
  pytest.skip("Triton routing kernels need a CUDA GPU", allow_module_level=True)
pytest.importorskip("jax_triton")

from mhar_jax import kernels  # noqa: E402
from mhar_jax.kernels import reference  # noqa: E402
from mhar_jax.kernels import triton_route as tr  # noqa: E402

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _rel(a, b, floor=0.0):
  """``|a - b| / max(|b|, floor)``; ``floor`` scales an exactly-zero ``b``."""
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
  assert np.isfinite(a).all(), "non-finite values (unwritten output?)"
  nb = max(np.linalg.norm(b), floor)
  if nb == 0.0:
    return float(np.linalg.norm(a))
  return float(np.linalg.norm(a - b) / nb)


_SEED = [0]


def _inputs(s, lead, d, dtype):
  _SEED[0] += 1
  keys = jax.random.split(jax.random.PRNGKey(1000 + _SEED[0]), s + 3)
  srcs = [(jax.random.normal(keys[i], (*lead, d)) * (0.5 + 0.7 * (i % 4))
           + 0.3 * ((i % 3) - 1)).astype(dtype) for i in range(s)]
  query = jax.random.normal(keys[s], (d,)) * 0.4
  scale = 1.0 + 0.3 * jax.random.normal(keys[s + 1], (d,))
  dout = jax.random.normal(keys[s + 2], (*lead, d)).astype(dtype)
  return srcs, query, scale, dout


def _compare(s, lead, d, h, dtype, *, stacked=False, remat=False, chunk=None,
             exact_bwd=True, tol=None, route_kw=None, wrap=None,
             param_floor=0.0):
  srcs, query, scale, dout = _inputs(s, lead, d, dtype)
  arg = jnp.stack(srcs) if stacked else srcs
  kw = dict(route_kw or {})

  def f_ref(x, q, g):
    return reference.route(x, q, g, num_heads=h)

  def f_tri(x, q, g):
    return tr.route(x, q, g, num_heads=h, exact_bwd=exact_bwd, **kw)

  if remat:
    f_tri = jax.checkpoint(f_tri)

  def run(f):
    def both(x, q, g, dy):
      out, vjp = jax.vjp(f, x, q, g)
      return out, vjp(dy)
    call = jax.jit(both)
    return wrap(call, arg, query, scale, dout) if wrap else call(
        arg, query, scale, dout)

  old_chunk = tr.CHUNK
  try:
    if chunk is not None:
      tr.CHUNK = chunk
    with tr.poison_outputs():
      out, (dx, dq, dg) = run(f_tri)
  finally:
    tr.CHUNK = old_chunk
  out_r, (dx_r, dq_r, dg_r) = run(f_ref)
  tol = tol if tol is not None else TOL[dtype]
  assert out.dtype == out_r.dtype and out.shape == out_r.shape
  errs = {"out": _rel(out, out_r),
          "dquery": _rel(dq, dq_r, param_floor),
          "dscale": _rel(dg, dg_r, param_floor)}
  if stacked:
    errs["dsources"] = _rel(dx, dx_r)
  else:
    for i, (a, b) in enumerate(zip(dx, dx_r)):
      assert a.dtype == b.dtype
      errs[f"dsource{i}"] = _rel(a, b)
  bad = {k: v for k, v in errs.items() if not v <= tol}
  assert not bad, f"errors over {tol}: {bad} (all: {errs})"
  return errs


def _param_grad_scale(lead, d, h):
  """|d query| of a two-source reference call: the scale of a nonzero one."""
  srcs, query, scale, dout = _inputs(2, lead, d, jnp.float32)
  _, vjp = jax.vjp(lambda q: reference.route(srcs, q, scale, num_heads=h),
                   query)
  return float(jnp.linalg.norm(vjp(dout)[0]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_source(dtype):
  # With one source the weights are exactly 1 and the true d query is 0; the
  # kernel's is rounding noise, measured against a two-source gradient's size.
  _compare(1, (300,), 1280, 8, dtype,
           param_floor=_param_grad_scale((300,), 1280, 8))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_d1280_h8_ragged_tokens(dtype):
  # 3 * 337 = 1011 tokens: not a multiple of any block size.
  _compare(8, (3, 337), 1280, 8, dtype)


@pytest.mark.parametrize("h", [1, 16, 5])
def test_heads(h):
  # H=1 (AttnRes, C=1280 padded to 2048), H=16 (C=80), H=5 (C=256, H padded).
  _compare(4, (517,), 1280, h, jnp.float32)


def test_small_width_many_heads():
  _compare(6, (2, 100), 512, 32, jnp.float32)  # C = 16


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_multiple_launches(dtype):
  # S=10 in chunks of 4: three launches, state carried twice, ragged last.
  _compare(10, (777,), 1280, 8, dtype, chunk=4)


def test_default_chunk_many_sources():
  # S=37 > CHUNK: the configuration of a deep model's later sites.
  _compare(37, (1024,), 1280, 8, jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_backward_computing_inverse_rms(monkeypatch, dtype):
  # bwd_given_r off: the c-pass and backward sum squares themselves (on by
  # default: the forward writes each source's inverse RMS for them).
  from mhar_jax.kernels import triton_route
  monkeypatch.setitem(triton_route.TUNING, "bwd_given_r", False)
  _compare(10, (777,), 1280, 8, dtype, chunk=4)


def test_stacked_input():
  _compare(5, (2, 129), 1280, 8, jnp.float32, stacked=True)


def test_remat():
  _compare(6, (513,), 1280, 8, jnp.float32, remat=True)


def test_fast_backward():
  _compare(6, (513,), 1280, 8, jnp.float32, exact_bwd=False)
  _compare(6, (513,), 1280, 8, jnp.bfloat16, exact_bwd=False, tol=2e-2)


def test_one_device_mesh_shard_map():
  mesh = jax.make_mesh((1,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:1])
  # Forced shard_map path (mesh passed explicitly) ...
  _compare(5, (4, 130), 1280, 8, jnp.float32,
           route_kw=dict(mesh=mesh.abstract_mesh, batch_axes=("data",)))

  # ... and the default path under a 1-device mesh context (direct call).
  def in_mesh(call, *args):
    with jax.set_mesh(mesh):
      return call(*args)
  _compare(5, (4, 130), 1280, 8, jnp.float32, wrap=in_mesh)


def test_dispatcher():
  srcs, query, scale, _ = _inputs(3, (64,), 512, jnp.float32)
  got = kernels.route(srcs, query, scale, num_heads=8, impl="triton")
  want = kernels.route(srcs, query, scale, num_heads=8, impl="reference")
  assert _rel(got, want) <= 1e-5
  assert kernels.resolve_impl("auto") == "triton"


def test_ptx_from_the_disk_cache_builds_the_same_program(tmp_path,
                                                         monkeypatch):
  # A process that finds every kernel's PTX on disk (kernels/ptx_cache.py,
  # under JAX's compilation cache directory) must lower exactly the program
  # of the process that compiled it, and compute the same values.
  import os
  import jax_triton as jt
  from mhar_jax.kernels import ptx_cache
  srcs, query, scale, dout = _inputs(5, (301,), 1280, jnp.bfloat16)

  def both(route):
    def f(x, q, g, dy):
      out, vjp = jax.vjp(lambda *a: route(*a, num_heads=8), x, q, g)
      return out, vjp(dy)
    return f

  def lower():
    jt.triton_lib._COMPILED_KERNEL_CACHE.clear()   # as in a fresh process
    jax.clear_caches()
    return jax.jit(both(tr.route)).lower(srcs, query, scale, dout)

  old = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", str(tmp_path))
  try:
    compiled = lower()
    entries = sorted(os.listdir(tmp_path / ptx_cache.SUBDIR))
    assert len(entries) >= 2, entries    # forward and backward kernels at least

    def must_not_compile(*args):
      raise AssertionError("a kernel was compiled although its PTX was cached")
    monkeypatch.setattr(jt.triton_lib, "compile_ttir_inplace",
                        tr._ptx_cached(must_not_compile))
    cached = lower()
  finally:
    jax.config.update("jax_compilation_cache_dir", old)
  assert sorted(os.listdir(tmp_path / ptx_cache.SUBDIR)) == entries
  assert cached.as_text() == compiled.as_text()
  out, (dx, dq, dg) = cached.compile()(srcs, query, scale, dout)
  out_r, (dx_r, dq_r, dg_r) = jax.jit(both(reference.route))(
      srcs, query, scale, dout)
  errs = [_rel(out, out_r), _rel(dq, dq_r), _rel(dg, dg_r)]
  errs += [_rel(a, b) for a, b in zip(dx, dx_r)]
  assert max(errs) <= TOL[jnp.bfloat16], errs
