"""A sublayer input norm's backward as ``routed_stack`` takes it, against its byte floor.

The backward of each routed sublayer takes its input RMSNorm's gradient
itself at the site's output ``x [N, D]`` for the cotangent ``dy`` of the
norm's output, writes ``dx`` into a row of the cotangent buffer and takes
``<dx, x>`` per head (the routing's backward) and the gain's gradient. Timed
here alone, ``--sites`` sites in turn in one jitted call (bf16 ``x`` and
``dy``; the cotangent buffer and the ``<dx, x>`` rows donated and updated in
place), two ways: ``xla``, autodiff of the norm (the jnp path), and
``kernel``, ``triton_stack.norm_grad`` (the Triton path; GPU only).

``--terms T`` (> 1) gives each site's ``dy`` as T arrays, the cotangents of
the T matrix products reading the sublayer's input (attention's Q, K, V: 3;
SwiGLU's gate and up: 2), which autodiff adds: ``xla`` and ``kernel`` add
them in XLA first (``xla`` can fuse the add into its norm backward, as the
baseline does; before the kernel it is a kernel of its own), and
``terms`` hands them to the kernel, which adds them itself
(``NORM_TUNING["dy_terms"]``).

Bytes: the least any implementation moves is ``x`` and ``dy`` (its T terms)
read once and ``dx`` written once, ``(2 + T) N D`` bf16 elements; reported as GB/s of that and
as a share of a device copy's bandwidth measured in the same run, and the
time a site would take at that copy bandwidth (``floor ms``). Median of
``--reps`` calls after a warm-up, divided by the sites a call.

Usage (on the device machine, after ``source benchmarks/gpu_env.sh``)::

    python3 benchmarks/norm_grad.py                  # 100m / 350m / 1b widths
    python3 benchmarks/norm_grad.py --tokens 32768 --widths 1280 --reps 50
    python3 benchmarks/norm_grad.py --terms 3        # the sum before the kernel
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mhar_jax.kernels import reference, stack  # noqa: E402
from stack_routing import copy_bandwidth, median_ms  # noqa: E402

EPS = 1e-6


def norm_backward(x, scale, dy, heads):
  """``(dx, <dx, x> [N, H], dgain [D])`` of one site, as the stack takes
  them."""
  _, vjp = jax.vjp(lambda x, s: reference.rms_norm(x, s, EPS), x, scale)
  dx, dscale = vjp(dy)
  return dx, stack.dot_heads(dx, x, heads), dscale


def sites_backward(xs, scales, dys, buf, xd, heads, kernel=False,
                   terms=False):
  """Every site's norm backward in turn (``xs [K, N, D]``, ``dys [K, T, N,
  D]`` each site's cotangent as T terms, ``scales [K, D]``), ``dx`` into row
  ``k + 1`` of ``buf [K + 1, N, D]`` and ``<dx, x>`` into row ``k`` of ``xd
  [K, N, H]`` in place, as the stack's backward writes them (``kernel``: by
  ``triton_stack.norm_grad``, given the terms' sum, or with ``terms`` the
  terms); returns ``(buf, xd, dgains [K, D])``."""
  if kernel:
    from mhar_jax.kernels import triton_stack   # GPU only
  dscales = []
  for k in range(xs.shape[0]):
    parts = [dys[k, t] for t in range(dys.shape[1])]
    dy = functools.reduce(jnp.add, parts)       # as autodiff's add_any
    if kernel:
      buf, xd_k, dscale = triton_stack.norm_grad(
          xs[k], scales[k], parts if terms else dy, EPS, heads, buf, k + 1)
    else:
      dx, xd_k, dscale = norm_backward(xs[k], scales[k], dy, heads)
      buf = buf.at[k + 1].set(dx)
    xd = xd.at[k].set(xd_k)
    dscales.append(dscale)
  return buf, xd, jnp.stack(dscales)


@contextlib.contextmanager
def norm_tuning(tuning):
  """``triton_stack.NORM_TUNING`` (read when a call is traced) updated with
  ``tuning`` inside the block."""
  from mhar_jax.kernels import triton_stack   # GPU only
  saved = dict(triton_stack.NORM_TUNING)
  triton_stack.NORM_TUNING.update(tuning)
  try:
    yield
  finally:
    triton_stack.NORM_TUNING.clear()
    triton_stack.NORM_TUNING.update(saved)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tokens", type=int, default=32768)
  p.add_argument("--widths", default="512,1024,1280",
                 help="comma list of D (the 100m / 350m / 1b presets')")
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--sites", type=int, default=8,
                 help="sites a call (one jitted function, in turn)")
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--terms", type=int, default=1,
                 help="each dy as this many arrays (1-3), added by autodiff")
  p.add_argument("--tunings", default="",
                 help="';'-separated kernel tunings to time besides the"
                      " default, each 'key=value,...' over"
                      " triton_stack.NORM_TUNING, e.g."
                      " 'programs_per_sm=8;stages=2,elems_per_thread=32'")
  args = p.parse_args()
  copy_gbs = copy_bandwidth() / 1e9
  print(f"device {jax.devices()[0].device_kind}; copy {copy_gbs:.0f} GB/s;"
        f" {args.tokens} tokens, {args.heads} heads, {args.sites} sites a call")
  ways = {"xla": None}
  if jax.default_backend() == "gpu":
    ways["kernel"] = {}
    if args.terms > 1:
      ways["terms"] = {"dy_terms": args.terms}
    for i, spec in enumerate(filter(None, args.tunings.split(";"))):
      ways[f"kernel{i + 1}"] = {k: int(v) for k, v in (
          kv.split("=") for kv in spec.split(","))}
      print(f"kernel{i + 1}: {ways[f'kernel{i + 1}']}")
  print(f"\n{'D':>6} {'way':>7} {'ms/site':>8} {'floor ms':>9} {'GB/s':>7}"
        f" {'% copy':>7} {'/ xla':>6} {'max |diff|':>10}")
  k, n = args.sites, args.tokens
  for d in map(int, args.widths.split(",")):
    rng = np.random.default_rng(d)
    xs = jnp.asarray(rng.normal(size=(k, n, d)) * 2, jnp.bfloat16)
    dys = jnp.asarray(rng.normal(size=(k, args.terms, n, d)), jnp.bfloat16)
    scales = jnp.asarray(1 + 0.3 * rng.normal(size=(k, d)), jnp.float32)
    times, outs = {}, {}
    for way, tuning in ways.items():
      f = jax.jit(functools.partial(sites_backward, heads=args.heads,
                                    kernel=tuning is not None,
                                    terms=way == "terms"),
                  donate_argnums=(3, 4))
      bufs = (jnp.zeros((k + 1, n, d), jnp.bfloat16),
              jnp.zeros((k, n, args.heads), jnp.float32))

      def call(xs, scales, dys):
        nonlocal bufs
        *bufs, dscales = f(xs, scales, dys, *bufs)
        return dscales

      with (contextlib.nullcontext() if tuning is None
            else norm_tuning(tuning)):          # traced inside
        times[way] = median_ms(call, (xs, scales, dys), reps=args.reps) / k
        dscales = call(xs, scales, dys)
      outs[way] = (bufs[0][1:], bufs[1], dscales)
      gb = (2 + args.terms) * n * d * 2 / 1e9   # x, dy's terms, dx (bf16)
      gbs = gb / (times[way] / 1e3)
      # the kernel's outputs against XLA's (dx, <dx, x>, dgain), largest
      # difference relative to the largest element
      diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32)
                                       - b.astype(jnp.float32)))
                       / jnp.max(jnp.abs(b.astype(jnp.float32))))
                 for a, b in zip(outs[way], outs["xla"]))
      print(f"{d:>6} {way:>7} {times[way]:8.3f} {1e3 * gb / copy_gbs:9.3f}"
            f" {gbs:7.0f} {100 * gbs / copy_gbs:7.1f}"
            f" {times[way] / times['xla']:6.3f} {diff:10.2e}")


if __name__ == "__main__":
  main()
