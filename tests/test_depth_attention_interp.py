"""benchmarks/depth_attention.py's kernel (an experiment: G sites on tensor
cores) under Triton's interpreter against the jnp routing of G sites."""

import os
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp

if jax.default_backend() == "gpu":   # the benchmark checks itself there
  pytest.skip("interpreter test: CPU only", allow_module_level=True)
from helpers import (interpreted_kernels, to_torch,  # noqa: E402
                     use_triton_interpreter)

torch = pytest.importorskip("torch")
use_triton_interpreter()
triton = pytest.importorskip("triton")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)),
                                "benchmarks"))
import depth_attention  # noqa: E402

from mhar_jax.kernels import reference, stack  # noqa: E402


@pytest.fixture(scope="module")
def tr():
  yield from interpreted_kernels("mhar_jax.kernels.triton_route")


@pytest.mark.parametrize("n,d,h,s,bt", [
    (5, 320, 2, 19, 2),     # C = 160 = 128 + 32; two source blocks, ragged
    (3, 64, 4, 7, 4),       # C = 16: one part
])
def test_kernel_matches_jnp_sites(tr, n, d, h, s, bt):
  g = 16
  rng = np.random.default_rng(n + d + s)
  x = jnp.asarray(rng.normal(size=(s, n, d)) * 1.3, jnp.bfloat16)
  r = reference.inv_rms(x, 1e-6)
  t = jnp.asarray(0.5 * rng.normal(size=(g, d)) / np.sqrt(d / h), jnp.float32)
  plan = stack._Plan(h, 1e-6, "reference")
  want, want_lse = stack._sites([x[i] for i in range(s)],
                                t.reshape(g, h, -1), [r[i] for i in range(s)],
                                plan)
  c = d // h
  ca, cb = tr.head_parts(c)
  # fp32 operands (LOWP=False: the interpreter's bf16 products are wrong);
  # the GPU run of benchmarks/depth_attention.py checks the bf16 ones
  X = to_torch(x)
  out = torch.full((g, n, d), float("nan"))
  lse = torch.full((g, n, h), float("nan"))
  depth_attention.depth_attention_kernel[(triton.cdiv(n, bt), h)](
      X, to_torch(r), to_torch(t), s,
      n, out, lse, D=d, H=h, C=c, CA=ca, CB=cb, G=g, SB=16, BT=bt,
      STAGES=2, LOWP=False)
  got = out.float().numpy()
  assert np.isfinite(got).all() and np.isfinite(lse.numpy()).all()
  want = np.asarray(want.astype(jnp.float32))
  assert np.abs(got - want).max() / np.abs(want).max() < 1e-2
  np.testing.assert_allclose(lse.numpy(), np.asarray(want_lse), atol=1e-4)
