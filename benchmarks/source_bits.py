"""What reading the routing's sources in 8 bits does to training (no kernel).

    python3 benchmarks/source_bits.py [--seeds 0,1] [--steps 400]
        [--config configs/tiny.py] [--dtype bfloat16] [--eval_batches N]

No GPU needed. ``benchmarks/byte_bounds.py --source_bytes 1`` counts what an
8-bit copy of the sources would save the routing kernels; this measures what
it would cost the model. For each seed it trains the config twice, with the
same initialisation and data order: as built, and with every routing site
reading its sources as such a kernel would: each token's source ``s`` scaled
by its inverse RMS ``r`` (over all D channels), rounded to float8 e4m3, and
read back as ``q / r`` for both the keys and the values. Gradients pass
straight through the rounding (the kernel's backward would read the same
8-bit rows). Routing runs site by site (``model.routing_backward=site``,
the jnp path, the same function as the stack) in both arms. Prints each
run's final validation loss and bits per byte and the paired differences.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def read_8bit(s, eps: float):
  """``s [..., D]`` as an 8-bit read gives it: ``e4m3(s * r) / r`` with
  ``r = rsqrt(mean(s^2) + eps)`` per token, in ``s``'s dtype; the gradient
  passes straight through."""
  import jax
  import jax.numpy as jnp
  from mhar_jax.kernels.reference import inv_rms
  r = inv_rms(s, eps)[..., None]
  q = (s.astype(jnp.float32) * r).astype(jnp.float8_e4m3fn)
  return s + jax.lax.stop_gradient((q.astype(jnp.float32) / r).astype(s.dtype)
                                   - s)


def patch_routing():
  """Makes ``mhar_jax.kernels.route`` (what the site-by-site router calls)
  read its sources through :func:`read_8bit`."""
  from mhar_jax import kernels
  from mhar_jax.kernels.reference import as_source_list
  route = kernels.route

  def route_8bit(sources, query, norm_scale, *, num_heads, eps=1e-6,
                 impl=None):
    return route([read_8bit(s, eps) for s in as_source_list(sources)],
                 query, norm_scale, num_heads=num_heads, eps=eps, impl=impl)

  kernels.route = route_8bit
  return lambda: setattr(kernels, "route", route)


def train(config: str, seed: int, steps: int, dtype: str, eight_bit: bool,
          eval_batches: int | None = None):
  """Final eval of one run: ``{metric: value}``."""
  from mhar_jax.config import load_config_file, validate
  from mhar_jax.train import Trainer, resolve_data
  import jax

  cfg = load_config_file(config)
  cfg.model.update(routing_backward="site", dtype=dtype,
                   routing_impl="reference")
  cfg.train.update(seed=seed, steps=steps)
  cfg.eval.every = steps
  if eval_batches:
    cfg.eval.batches = eval_batches
  cfg.checkpoint.every = steps
  model_cfg = validate(cfg, num_devices=jax.device_count(),
                       process_count=jax.process_count())
  restore = patch_routing() if eight_bit else (lambda: None)
  try:
    with tempfile.TemporaryDirectory() as workdir:
      result = Trainer(cfg, model_cfg, workdir,
                       resolve_data(cfg, model_cfg)).run()
  finally:
    restore()
  return {k: float(v) for k, v in result.items()
          if k not in ("train_history", "step", "state")}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny.py"))
  ap.add_argument("--seeds", default="0,1")
  ap.add_argument("--steps", type=int, default=400)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--eval_batches", type=int, default=0,
                  help="validation batches (0: the config's eval.batches)")
  a = ap.parse_args()
  rows = []
  for seed in (int(s) for s in a.seeds.split(",")):
    base, q8 = (train(a.config, seed, a.steps, a.dtype, eight_bit=e,
                      eval_batches=a.eval_batches) for e in (False, True))
    rows.append((seed, base, q8))
    missing = sorted(set(base) ^ set(q8))
    if missing:      # a run stopped early (e.g. SIGTERM) returns no eval
      raise SystemExit(f"seed {seed}: only one run of the pair has {missing}")
    print(f"seed {seed}: " + ", ".join(
        f"{k} {base[k]:.4f} -> {q8[k]:.4f}" for k in sorted(base)
        if k.endswith(("loss", "bpb"))), flush=True)
  keys = sorted(rows[0][1])
  print(f"\n{os.path.relpath(a.config, ROOT)}, {a.steps} steps, {a.dtype},"
        " routing site by site (jnp); final eval:")
  print("| seed | " + " | ".join(f"{k} as built | {k} 8-bit sources | diff"
                                   for k in keys) + " |")
  print("|---|" + "---|---|---|" * len(keys))
  for seed, base, q8 in rows:
    print(f"| {seed} | " + " | ".join(
        f"{base[k]:.4f} | {q8[k]:.4f} | {q8[k] - base[k]:+.4f}" for k in keys)
        + " |")
  for k in keys:
    d = [q8[k] - base[k] for _, base, q8 in rows]
    print(f"{k}: mean difference {statistics.mean(d):+.4f}"
          + (f" (sd {statistics.stdev(d):.4f}, {len(d)} seeds)"
             if len(d) > 1 else ""))


if __name__ == "__main__":
  main()
