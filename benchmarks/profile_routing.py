"""Hardware counters of the routing kernels at the 1b shape (Nsight Compute).

Runs one routing computation per ``--what`` at N = 32,768 tokens, D = 1280,
H = 8, bf16, so that ``ncu`` can profile its kernels:

* ``fwd``: one site over 16 sources (one forward launch, no carries);
* ``fwd_r``: the same reading each source's inverse RMS (as ``routed_stack``
  calls it, ``triton_route.TUNING["fwd_given_r"]``);
* ``fwdbwd``: the same with the site-major backward (c-pass and backward);
* ``sites``: 8 sites over the same 8 sources in one launch (two-phase
  routing's first phase: do the programs of a token tile share loads in L2?);
* ``source_grad``: the source-major backward's kernel for one source read by
  37 sites (``triton_stack.source_grad_local``; ncu crashed profiling it
  inside a whole ``routed_stack`` program).

Each computation runs twice (the first compiles); profile the second::

    source benchmarks/gpu_env.sh
    ncu --clock-control none -k regex:_fwd_kernel --launch-skip 1 -c 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section SchedulerStats --section WarpStateStats \\
        --section Occupancy --section LaunchStats \\
        python3 benchmarks/profile_routing.py --what fwd

``benchmarks/gpu_profile.sh`` runs the set recorded in RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mhar_jax.kernels import reference  # noqa: E402

N, D, H = 32768, 1280, 8


def _inputs(s, seed=0):
  keys = jax.random.split(jax.random.key(seed), s + 2)
  srcs = [(jax.random.normal(keys[i], (N, D)) * (0.5 + i % 3))
          .astype(jnp.bfloat16) for i in range(s)]
  return srcs, keys[s], keys[s + 1]


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--what", choices=("fwd", "fwd_r", "fwdbwd", "sites", "source_grad"),
                  required=True)
  args = ap.parse_args()
  from mhar_jax.kernels import triton_route   # needs a GPU jaxlib
  if args.what in ("fwd", "fwd_r", "fwdbwd"):
    srcs, kq, kd = _inputs(16)
    q = 0.3 * jax.random.normal(kq, (D,))
    g = jnp.ones((D,))
    route = lambda s, q: triton_route.route(s, q, g, num_heads=H)  # noqa: E731
    if args.what == "fwd":
      fn, call = jax.jit(route), (srcs, q)
    elif args.what == "fwd_r":
      cfg = triton_route._make_cfg(D, H, 1e-6, True, None, ())
      rs = [reference.inv_rms(s, 1e-6) for s in srcs]
      fn = jax.jit(lambda s, rs, q: triton_route._fwd_impl(
          s, triton_route._t(q, g)[None], cfg, rs=rs))
      call = (srcs, rs, q)
    else:
      dy = jax.random.normal(kd, (N, D)).astype(jnp.bfloat16)
      fn = jax.jit(lambda s, q: jax.vjp(route, s, q)[1](dy))
      call = (srcs, q)
  elif args.what == "sites":
    srcs, kq, _ = _inputs(8)
    t = 0.3 * jax.random.normal(kq, (8, D))
    cfg = triton_route._make_cfg(D, H, 1e-6, True, None, ())
    fn, call = jax.jit(lambda s, t: triton_route._fwd_impl(s, t, cfg)), (srcs,
                                                                         t)
  else:
    from mhar_jax.kernels import triton_stack
    from source_grad import inputs
    fn = jax.jit(lambda *x: triton_stack.source_grad_local(*x, 0, H))
    call = inputs(N, 37, D, H)
  for _ in range(2):
    jax.block_until_ready(fn(*call))
  print(f"profile_routing: {args.what} done", flush=True)


if __name__ == "__main__":
  main()
