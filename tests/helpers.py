"""Shared test helpers (importable from the test modules: pytest puts tests/ on sys.path)."""

import jax

from mhar_jax.config import validate


def make_trainer(cfg, workdir):
  """The real Trainer for ``cfg`` on one CPU device (conftest forces 8)."""
  from mhar_jax.train import Trainer, resolve_data
  m = validate(cfg, num_devices=1)
  return Trainer(cfg, m, str(workdir), resolve_data(cfg, m),
                 devices=jax.devices()[:1])


def recompute_kwargs(recompute: str) -> dict:
  """The decoder tests' ``recompute`` as TransformerConfig keywords:
  ``"none"`` / ``"attention"`` / ``"all"`` are ``recompute_sources``;
  ``"outputs"`` / ``"outputs=0.5"`` are ``recompute_site_outputs`` 1 / 0.5."""
  if recompute.startswith("outputs"):
    return dict(recompute_sources="none",
                recompute_site_outputs=float(recompute.partition("=")[2] or 1))
  return dict(recompute_sources=recompute, recompute_site_outputs=0.0)


_UNSET = object()
_INTERPRET_AT_START = _UNSET


def use_triton_interpreter():
  """Sets ``TRITON_INTERPRET=1`` (call before importing triton: it is read
  then and when kernels are decorated), remembering the value the session
  started with for :func:`interpreted_kernels` to restore."""
  import os
  global _INTERPRET_AT_START
  if _INTERPRET_AT_START is _UNSET:
    _INTERPRET_AT_START = os.environ.get("TRITON_INTERPRET")
  os.environ["TRITON_INTERPRET"] = "1"


def interpreted_kernels(*names):
  """Generator for a module fixture: imports the kernel modules ``names``
  (``mhar_jax.kernels.triton_*``) under Triton's interpreter, with a stand-in
  for jax_triton (which needs a GPU jaxlib to import; only the @triton.jit
  kernels are used), yields the last, then restores sys.modules and the
  session's original ``TRITON_INTERPRET`` so later tests and their
  subprocesses see neither."""
  import importlib
  import os
  import sys
  import types
  use_triton_interpreter()
  saved = sys.modules.get("jax_triton")
  sys.modules["jax_triton"] = types.ModuleType("jax_triton")
  try:
    for name in names:
      sys.modules.pop(name, None)
    yield [importlib.import_module(n) for n in names][-1]
  finally:
    if _INTERPRET_AT_START is None:
      os.environ.pop("TRITON_INTERPRET", None)
    else:
      os.environ["TRITON_INTERPRET"] = _INTERPRET_AT_START
    for name in names:
      sys.modules.pop(name, None)
    if saved is None:
      sys.modules.pop("jax_triton", None)
    else:
      sys.modules["jax_triton"] = saved


def to_torch(x):
  """A float32 torch tensor holding a copy of array ``x``."""
  import numpy as np
  import torch
  return torch.from_numpy(np.array(x, np.float32))


def interpreted_launch(kernel, inputs, scalars, out_shapes, *, grid,
                       num_warps, carry=None, poison=False, dummy=None,
                       **meta):
  """``triton_route._launch`` run by Triton's interpreter on float32 torch
  tensors: the kernel gets ``inputs``, one unused init per output,
  ``scalars``, then the outputs (an output in ``carry`` starts as a copy of
  that input, the others as NaN), as jax-triton passes them. Needs concrete
  arrays (call the code under test eagerly)."""
  import jax.numpy as jnp
  import torch
  del num_warps, poison
  for j, i in (carry or {}).items():   # XLA aliases only equal buffers
    assert (inputs[i].shape, inputs[i].dtype) == (out_shapes[j].shape,
                                                  out_shapes[j].dtype), (j, i)
  args = [to_torch(x) for x in inputs]
  outs = [args[carry[j]].clone() if carry and j in carry
          else torch.full(s.shape, float("nan")) for j, s in
          enumerate(out_shapes)]
  kernel[grid](*args, *([to_torch(dummy)] * len(out_shapes)), *scalars, *outs,
               **meta)
  return [jnp.asarray(o.numpy()).astype(s.dtype)
          for o, s in zip(outs, out_shapes)]


def jnp_fwd_local(num_heads, eps):
  """A stand-in for ``triton_route._fwd_local`` computing the same function
  with the jnp two-phase routing of :mod:`mhar_jax.kernels.stack` (for tests
  of the sharded plumbing around the kernels); checks that given inverse
  RMS have the sources' shapes."""
  import jax.numpy as jnp

  from mhar_jax.kernels import reference, stack
  plan = stack._Plan(num_heads, eps, "reference")

  def local(srcs, t, cfg, init=None, rs=None, write_r=False):
    assert not write_r
    tg = t.reshape(t.shape[0], num_heads, -1)
    r = [reference.inv_rms(s, eps) for s in srcs]
    if rs is not None:
      assert [x.shape for x in rs] == [x.shape for x in r]
      r = list(rs)
    if init is None:
      return stack._sites(list(srcs), tg, r, plan)
    outs, lses, i0 = init
    res = [stack._continue(outs, lses, i0 + g, list(srcs), tg[g], r, plan)
           for g in range(tg.shape[0])]
    return jnp.stack([o for o, _ in res]), jnp.stack([x for _, x in res])
  return local
