"""A sublayer input norm's backward as ``routed_stack`` takes it, against its byte floor.

With ``recompute_site_outputs``, the backward of each routed sublayer takes
its input RMSNorm's gradient itself (``jax.vjp`` of the norm) at the site's
output ``x [N, D]`` for the cotangent ``dy`` of the norm's output, writes
``dx`` into a row of the cotangent buffer and takes ``<dx, x>`` per head (the
routing's backward) and the gain's gradient. Timed here alone, XLA-compiled
(bf16 ``x`` and ``dy``, a ``[4, N, D]`` bf16 buffer donated and updated in
place): the case for one fused kernel.

Bytes: the least any implementation moves is ``x`` and ``dy`` read once and
``dx`` written once, ``3 N D`` bf16 elements; reported as GB/s of that and
as a share of a device copy's bandwidth measured in the same run. Median of
``--reps`` calls after a warm-up.

Usage (on the device machine, after ``source benchmarks/gpu_env.sh``)::

    python3 benchmarks/norm_grad.py                  # 100m / 350m / 1b widths
    python3 benchmarks/norm_grad.py --tokens 32768 --widths 1280 --reps 50
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mhar_jax.kernels import reference  # noqa: E402
from stack_routing import copy_bandwidth, median_ms  # noqa: E402

EPS = 1e-6


def norm_backward(x, scale, dy, buf, row, heads):
  """``(buf with dx in row, <dx, x> [N, H], dgain [D])``, as the stack
  takes them."""
  _, vjp = jax.vjp(lambda x, s: reference.rms_norm(x, s, EPS), x, scale)
  dx, dscale = vjp(dy)
  xd = jnp.einsum("...hc,...hc->...h", reference._heads(dx, heads),
                  reference._heads(x, heads))
  return buf.at[row].set(dx), xd, dscale


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tokens", type=int, default=32768)
  p.add_argument("--widths", default="512,1024,1280",
                 help="comma list of D (the 100m / 350m / 1b presets')")
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--reps", type=int, default=30)
  args = p.parse_args()
  copy_gbs = copy_bandwidth() / 1e9
  print(f"device {jax.devices()[0].device_kind}; copy {copy_gbs:.0f} GB/s")
  print(f"\n{'D':>6} {'ms':>8} {'GB/s':>7} {'% copy':>7}")
  for d in map(int, args.widths.split(",")):
    rng = np.random.default_rng(d)
    x = jnp.asarray(rng.normal(size=(args.tokens, d)) * 2, jnp.bfloat16)
    dy = jnp.asarray(rng.normal(size=(args.tokens, d)), jnp.bfloat16)
    scale = jnp.asarray(1 + 0.3 * rng.normal(size=(d,)), jnp.float32)
    f = jax.jit(functools.partial(norm_backward, heads=args.heads),
                donate_argnums=3, static_argnums=4)
    buf = jnp.zeros((4, args.tokens, d), jnp.bfloat16)

    def call(x, scale, dy):
      nonlocal buf
      buf, xd, dscale = f(x, scale, dy, buf, 2)
      return xd, dscale

    ms = median_ms(call, (x, scale, dy), reps=args.reps)
    gbs = 3 * args.tokens * d * 2 / 1e9 / (ms / 1e3)
    print(f"{d:>6} {ms:8.3f} {gbs:7.0f} {100 * gbs / copy_gbs:7.1f}")


if __name__ == "__main__":
  main()
