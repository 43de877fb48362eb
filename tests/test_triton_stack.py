"""The source-major backward kernel (kernels/triton_stack.py) under Triton's interpreter.

Runs on CPU where ``triton`` and ``torch`` are installed (``TRITON_INTERPRET=1``
executes the kernel in numpy); skipped elsewhere. It checks the kernel's
indexing and math against ``stack.source_grad``; the GPU build and its speed
are checked on the device (benchmarks/).
"""

import os
import sys
import types

import numpy as np
import pytest

import jax
import jax.numpy as jnp

if jax.default_backend() == "gpu":   # there tests/test_stack_gpu.py runs the real build
  pytest.skip("interpreter test: CPU only", allow_module_level=True)
torch = pytest.importorskip("torch")
_SAVED_ENV = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"     # read when triton is imported
triton = pytest.importorskip("triton")

from mhar_jax.kernels import reference, stack


@pytest.fixture(scope="module")
def kernel_module():
  """Imports triton_stack with a stand-in for jax_triton (which needs a GPU
  jaxlib to import); only the @triton.jit kernel is used here."""
  saved = sys.modules.get("jax_triton")
  sys.modules["jax_triton"] = types.ModuleType("jax_triton")
  try:
    for name in ("mhar_jax.kernels.triton_stack", "mhar_jax.kernels.triton_route"):
      sys.modules.pop(name, None)
    from mhar_jax.kernels import triton_stack
    yield triton_stack
  finally:
    if _SAVED_ENV is None:     # keep it out of later tests' subprocesses
      os.environ.pop("TRITON_INTERPRET", None)
    else:
      os.environ["TRITON_INTERPRET"] = _SAVED_ENV
    for name in ("mhar_jax.kernels.triton_stack", "mhar_jax.kernels.triton_route"):
      sys.modules.pop(name, None)
    if saved is None:
      sys.modules.pop("jax_triton", None)
    else:
      sys.modules["jax_triton"] = saved


@pytest.mark.parametrize("n_tok,d,h,rows,i", [(37, 64, 4, 5, 0), (16, 40, 8, 3, 2),
                                               (9, 24, 1, 4, 3), (5, 48, 16, 2, 1)])
def test_kernel_matches_reference(kernel_module, n_tok, d, h, rows, i):
  rng = np.random.default_rng(n_tok + d)
  s = rng.normal(size=(n_tok, d)).astype(np.float32)
  r = np.asarray(reference.inv_rms(jnp.asarray(s), 1e-6))
  dX = rng.normal(size=(rows, n_tok, d)).astype(np.float32)
  t = rng.normal(size=(rows, d)).astype(np.float32)
  # a log-sum-exp at least the source's own logit, as in a real site (w <= 1)
  u = np.einsum("nhc,khc->knh", s.reshape(n_tok, h, d // h),
                t.reshape(rows, h, d // h))
  lse = (r[None, :, None] * u
         + np.abs(rng.normal(size=(rows, n_tok, h))) + 0.1).astype(np.float32)
  xd = rng.normal(size=(rows, n_tok, h)).astype(np.float32)
  m = rows - i
  c = d // h
  # reference: the jnp version of the same buffer interface
  # the source sits at row i of whole-stack buffers
  S = rng.normal(size=(rows, n_tok, d)).astype(np.float32)
  S[i] = s
  R = np.asarray(reference.inv_rms(jnp.asarray(S), 1e-6))
  ds_ref, dt_ref = stack.source_grad(jnp.asarray(S), jnp.asarray(R),
                                     jnp.asarray(dX), jnp.asarray(t),
                                     jnp.asarray(lse), jnp.asarray(xd), i, h)
  ts = kernel_module
  bn = ts.tokens_per_program(d, h)
  ds = torch.full((n_tok, d), float("nan"))
  dlr = torch.full((m, n_tok, h), float("nan"))
  T = lambda a: torch.from_numpy(np.ascontiguousarray(a))
  grid = (triton.cdiv(n_tok, bn),)
  ts.source_grad_kernel[grid](
      T(S), T(R), T(dX), T(t), T(lse), T(xd), i, m, n_tok, ds, dlr,
      D=d, H=h, C=c, HP=ts._pow2(h), CP=ts._pow2(c), BN=bn, STAGES=ts.STAGES)
  ds_ref = np.asarray(ds_ref).reshape(n_tok, d)
  assert np.isfinite(ds.numpy()).all() and np.isfinite(dlr.numpy()).all()
  assert np.abs(ds.numpy() - ds_ref).max() <= 1e-5 * np.abs(ds_ref).max()
  dt = np.einsum("mnh,nhc->mhc", dlr.numpy(), s.reshape(n_tok, h, c))
  dt_ref = np.asarray(dt_ref).reshape(m, h, c)
  assert np.abs(dt - dt_ref).max() <= 1e-5 * np.abs(dt_ref).max()


@pytest.mark.parametrize("n_tok,d,h,g,i0,ns", [(37, 64, 4, 3, 0, 5),
                                               (16, 40, 8, 1, 2, 3),
                                               (9, 24, 1, 4, 1, 2),
                                               (5, 48, 16, 8, 0, 1),
                                               (70, 32, 2, 5, 3, 4)])
def test_site_group_kernel_matches_reference(kernel_module, n_tok, d, h, g,
                                             i0, ns):
  """One pass for g sites, then one resumed site, against stack.site_group."""
  rng = np.random.default_rng(n_tok + d + g)
  rows = i0 + ns + 2
  S = (rng.normal(size=(rows, n_tok, d)) * 2 + 0.3).astype(np.float32)
  R = np.asarray(reference.inv_rms(jnp.asarray(S), 1e-6))
  t = rng.normal(size=(g, d)).astype(np.float32)
  ts = kernel_module
  T = lambda a: torch.from_numpy(np.ascontiguousarray(a))
  c = d // h
  meta = dict(D=d, H=h, C=c, HP=ts._pow2(h), CP=ts._pow2(c), STAGES=ts.STAGES)

  def run(t, i0, ns, resume):
    gg = t.shape[0]
    bn = ts.group_tokens_per_program(d, h, gg)
    out = torch.full((n_tok, d), float("nan"))
    lse = torch.full((n_tok, h), float("nan"))
    pout = torch.full((max(gg - 1, 1), n_tok, d), float("nan"))
    plse = torch.full((max(gg - 1, 1), n_tok, h), float("nan"))
    pin, plin, kp = resume if resume is not None else (t, t, 0)
    ts.site_group_kernel[(triton.cdiv(n_tok, bn),)](
        T(S), T(R), T(t), T(pin), T(plin), i0, ns, kp, n_tok,
        out, lse, pout, plse, G=gg, GP=ts._pow2(gg),
        RESUME=resume is not None, BN=bn, **meta)
    return (out.numpy(), lse.numpy(), pout.numpy()[:gg - 1],
            plse.numpy()[:gg - 1])

  def close(a, b):
    b = np.asarray(b)
    assert a.shape == b.shape
    if not b.size:
      return
    assert np.isfinite(a).all(), "an output element was not written"
    assert np.abs(a - b).max() <= 1e-5 * max(np.abs(b).max(), 1.0)

  got = run(t, i0, ns, None)
  want = stack.site_group(jnp.asarray(S), jnp.asarray(R), jnp.asarray(t), i0,
                          ns, None, h)
  for a, b in zip(got, want):
    close(a, b)
  if g > 1:   # site 1 resumes from its partial over the two next sources
    got = run(t[1:2], i0 + ns, 2, (got[2], got[3], 0))
    want = stack.site_group(jnp.asarray(S), jnp.asarray(R),
                            jnp.asarray(t[1:2]), i0 + ns, 2,
                            (want[2], want[3], 0), h)
    full = stack.site_group(jnp.asarray(S), jnp.asarray(R),
                            jnp.asarray(t[1:2]), i0, ns + 2, None, h)
    for a, b, f in zip(got[:2], want[:2], full[:2]):
      close(a, b)
      close(a, f)     # resuming computes the whole softmax
