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


@pytest.mark.parametrize("n_tok,d,h,rows,si,g", [(37, 64, 4, 6, 3, 3),
                                                 (16, 40, 8, 4, 2, 1),
                                                 (9, 24, 1, 5, 3, 4),
                                                 (5, 48, 16, 3, 1, 2),
                                                 (70, 32, 2, 9, 7, 8)])
def test_source_group_grad_kernel_matches_reference(kernel_module, n_tok, d, h,
                                                    rows, si, g):
  """A pass for g sources over rows si.., then source si-1 resumed over row
  si-1, against stack.source_group_grad (and the one-pass gradient)."""
  rng = np.random.default_rng(n_tok + d + g)
  S = (rng.normal(size=(rows, n_tok, d)) * 2 + 0.3).astype(np.float32)
  R = np.asarray(reference.inv_rms(jnp.asarray(S), 1e-6))
  dX = rng.normal(size=(rows, n_tok, d)).astype(np.float32)
  t = rng.normal(size=(rows, d)).astype(np.float32)
  c = d // h
  # log-sum-exps at least every source's own logit, as in real sites (w <= 1)
  u = np.einsum("inhc,jhc->jinh", S.reshape(rows, n_tok, h, c),
                t.reshape(rows, h, c))
  lse = (np.max(R[None, :, :, None] * u, axis=1)
         + np.abs(rng.normal(size=(rows, n_tok, h))) + 0.1).astype(np.float32)
  xd = rng.normal(size=(rows, n_tok, h)).astype(np.float32)
  ts = kernel_module
  T = lambda a: torch.from_numpy(np.ascontiguousarray(a))
  J = lambda a: jnp.asarray(a)
  meta = dict(D=d, H=h, C=c, HP=ts._pow2(h), CP=ts._pow2(c), STAGES=ts.TUNING["stages"])

  def run(si, g, j0, m, resume):
    bn, warps = ts.source_group_grad_launch(d, h, g)
    ds = torch.full((n_tok, d), float("nan"))
    pacc = torch.full((max(g - 1, 1), n_tok, d), float("nan"))
    pcoef = torch.full((max(g - 1, 1), n_tok, h), float("nan"))
    dlr = torch.full((g, m, n_tok, h), float("nan"))
    pain, pcin, kp = resume if resume is not None else (t, t, 0)
    ts.source_group_grad_kernel[(triton.cdiv(n_tok, bn),)](
        T(S), T(R), T(dX), T(t), T(lse), T(xd), T(pain), T(pcin), si, j0, m,
        kp, n_tok, ds, pacc, pcoef, dlr, G=g, GP=ts._pow2(g),
        RESUME=resume is not None, BN=bn, **meta)
    srcs = S[si - g + 1:si + 1][::-1]
    dt = np.einsum("qknh,qnhc->qkhc", dlr.numpy(),
                   srcs.reshape(g, n_tok, h, c)).reshape(g, m, d)
    return ds.numpy(), pacc.numpy()[:g - 1], pcoef.numpy()[:g - 1], dt

  def close(a, b):
    b = np.asarray(b)
    assert a.shape == b.shape
    if not b.size:
      return
    assert np.isfinite(a).all(), "an output element was not written"
    assert np.abs(a - b).max() <= 2e-5 * max(np.abs(b).max(), 1.0)

  m = rows - si
  got = run(si, g, si, m, None)
  want = stack.source_group_grad(J(S), J(R), J(dX), J(t), J(lse), J(xd), si,
                                 g, si, m, None, h)
  for a, b in zip(got, want):
    close(a, b)
  if g > 1:
    got1 = run(si - 1, 1, si - 1, 1, (got[1], got[2], 0))
    want1 = stack.source_group_grad(J(S), J(R), J(dX), J(t), J(lse), J(xd),
                                    si - 1, 1, si - 1, 1,
                                    (want[1], want[2], 0), h)
    full = stack.source_group_grad(J(S), J(R), J(dX), J(t), J(lse), J(xd),
                                   si - 1, 1, si - 1, m + 1, None, h)
    close(got1[0], want1[0])
    close(got1[0], full[0])      # resuming gives the whole gradient
    close(np.concatenate([got1[3][0], got[3][1]]), full[3][0])


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
  meta = dict(D=d, H=h, C=c, HP=ts._pow2(h), CP=ts._pow2(c), STAGES=ts.TUNING["stages"])

  def run(t, i0, ns, resume):
    gg = t.shape[0]
    bn, warps = ts.site_group_launch(d, h, gg)
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
