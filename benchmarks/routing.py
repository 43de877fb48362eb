"""Routing benchmark: Triton kernels vs the pure-jnp reference (one GPU).

For each size (N tokens, S sources, D, H, dtype) it times, as the median of
many repetitions after a warm-up (wall clock around a jitted call with
``block_until_ready``; calls of milliseconds, so launch gaps are small):

* ``fwd``: ``route`` alone;
* ``fwd+bwd``: ``jax.vjp`` forward and backward (outputs and all gradients).

and reports the minimum bytes any implementation must move (each input read
once, each output written once), the bytes this kernel design moves, the
achieved GB/s, and that as a percentage of a copy bandwidth measured in the
same run (a large device-to-device copy: JAX elementwise ``x * c``, and a
torch ``copy_`` when torch is there; bytes read + written).

Byte counts, with E = N * D * itemsize, L = ceil(S / CHUNK) launches:

* minimum forward: (S + 1) E        (read S sources, write out)
* minimum fwd+bwd: (3S + 2) E       (+ read dout and S sources, write S grads)
* kernel forward: (S + 1) E + 8 N D (L - 1)   (fp32 carries between launches)
* kernel fwd+bwd, exact: forward + (3S + 2) E (two reads of the sources and
  of dout, S writes); fast (``exact_bwd=False``): forward + (2S + 3) E.

With ``--sites G`` it also times the forward of G sites over the same S
sources (two-phase routing's first phase, ``stack.routed_stack(...,
site_group=G)``): G separate launches against one launch of G sites, whose
programs for a token tile run side by side so their loads can hit L2. The
unique bytes are (S + G) E; the G launches read the sources G times.

Usage (on the device machine, after ``source benchmarks/gpu_env.sh``)::

    python3 benchmarks/routing.py                 # default sizes, table last
    python3 benchmarks/routing.py --sweep         # sweep configs, keep best
    python3 benchmarks/routing.py --json $OUT/routing.json
    python3 benchmarks/routing.py --sizes 32768x37 --sites 8 --no-ref
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mhar_jax.kernels import reference  # noqa: E402

DEFAULT_SIZES = [  # (N, S)
    (16384, 8), (32768, 8), (16384, 37), (32768, 37), (16384, 73),
    (32768, 73),
]


def _median_ms(fn, args, *, min_rep_s=0.02, reps=15, max_inner=50):
  """Warm-up (compile) then the median over ``reps`` timed loops, in ms."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  first = time.perf_counter() - t0
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  one = max(time.perf_counter() - t0, 1e-6)
  inner = int(min(max_inner, max(1, math.ceil(min_rep_s / one))))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = None
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / inner)
  return 1e3 * statistics.median(times), first, (
      1e3 * min(times), 1e3 * max(times))


def copy_bandwidth(mib=2048):
  """GB/s of large device copies (bytes read + written)."""
  res = {}
  n = mib * (1 << 19)  # bf16 elements in `mib` MiB
  x = jnp.ones((n,), jnp.bfloat16) * 1.25
  f = jax.jit(lambda x: x * jnp.bfloat16(1.5))
  ms, _, _ = _median_ms(f, (x,), reps=20)
  res["jax_elementwise"] = 2 * 2 * n / (ms * 1e-3) / 1e9
  del x
  try:
    import torch
    if torch.cuda.is_available():
      a = torch.empty(2 * n, dtype=torch.uint8, device="cuda").fill_(1)
      b = torch.empty_like(a)
      for _ in range(3):
        b.copy_(a)
      torch.cuda.synchronize()
      ts = []
      for _ in range(20):
        s, e = (torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True))
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
      res["torch_copy"] = 2 * 2 * n / (statistics.median(ts) * 1e-3) / 1e9
      del a, b
      torch.cuda.empty_cache()
  except Exception as e:  # noqa: BLE001
    res["torch_copy_error"] = repr(e)[:200]
  return res


def make_inputs(n, s, d, dtype, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), s + 3)
  srcs = [(jax.random.normal(keys[i], (n, d), jnp.float32) * (0.5 + i % 3))
          .astype(dtype) for i in range(s)]
  q = jax.random.normal(keys[s], (d,)) * 0.3
  g = 1.0 + 0.2 * jax.random.normal(keys[s + 1], (d,))
  dy = jax.random.normal(keys[s + 2], (n, d), jnp.float32).astype(dtype)
  return srcs, q, g, dy


def fns(route_fn, h):
  fwd = jax.jit(lambda s, q, g: route_fn(s, q, g, num_heads=h))

  def fb(s, q, g, dy):
    out, vjp = jax.vjp(lambda s, q, g: route_fn(s, q, g, num_heads=h), s, q, g)
    return out, vjp(dy)
  return fwd, jax.jit(fb)


def rel(a, b):
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def bench_size(tr, n, s, d, h, dtype, copy_gbs, *, with_ref=True,
               with_fast=True, check=True, with_r=False):
  srcs, q, g, dy = make_inputs(n, s, d, dtype, seed=n + s)
  e = n * d * jnp.dtype(dtype).itemsize
  chunks = math.ceil(s / tr.CHUNK)
  carry = 8 * n * d * (chunks - 1)
  b = {
      "min_fwd": (s + 1) * e, "min_fb": (3 * s + 2) * e,
      "k_fwd": (s + 1) * e + carry,
      "k_fb": (s + 1) * e + carry + (3 * s + 2) * e,
      "k_fb_fast": (s + 1) * e + carry + (2 * s + 3) * e,
  }
  rows = []

  def row(impl, what, ms, first, spread, moved, minb):
    rows.append(dict(
        N=n, S=s, D=d, H=h, dtype=jnp.dtype(dtype).name, impl=impl, what=what,
        ms=ms, compile_s=first, ms_min=spread[0], ms_max=spread[1],
        min_bytes=minb, moved_bytes=moved,
        gbs_min=minb / (ms * 1e-3) / 1e9,
        gbs_moved=moved / (ms * 1e-3) / 1e9 if moved else None,
        pct_copy_min=100 * minb / (ms * 1e-3) / 1e9 / copy_gbs,
        pct_copy_moved=(100 * moved / (ms * 1e-3) / 1e9 / copy_gbs
                        if moved else None)))
    r = rows[-1]
    print(f"  {impl:10s} {what:8s} N={n} S={s}: {ms:8.3f} ms "
          f"(compile+first {first:6.1f} s)  {r['gbs_min']:7.0f} GB/s min-bytes"
          f" = {r['pct_copy_min']:5.1f}% copy"
          + (f"; moved {r['gbs_moved']:7.0f} GB/s = {r['pct_copy_moved']:5.1f}%"
             if moved else ""), flush=True)

  tf, tfb = fns(lambda *a, **k: tr.route(*a, **k), h)
  ms, first, sp = _median_ms(tf, (srcs, q, g))
  row("triton", "fwd", ms, first, sp, b["k_fwd"], b["min_fwd"])
  if with_r:   # the stack's forward: each source's inverse RMS given
    cfg = tr._make_cfg(d, h, 1e-6, True, None, ())
    rs = [reference.inv_rms(x, 1e-6) for x in srcs]
    fr = jax.jit(lambda srcs, rs, q, g: tr._fwd_impl(
        srcs, tr._t(q, g)[None], cfg, rs=rs)[0][0])
    ms, first, sp = _median_ms(fr, (srcs, rs, q, g))
    diff = float(jnp.max(jnp.abs(fr(srcs, rs, q, g).astype(jnp.float32)
                                 - tf(srcs, q, g).astype(jnp.float32))))
    row("triton-r", "fwd", ms, first, sp, b["k_fwd"] + s * n * 4,
        b["min_fwd"])
    print(f"  triton-r vs triton: max |diff| {diff:.3g}", flush=True)
  ms, first, sp = _median_ms(tfb, (srcs, q, g, dy))
  row("triton", "fwd+bwd", ms, first, sp, b["k_fb"], b["min_fb"])
  if with_fast:
    _, ffb = fns(lambda *a, **k: tr.route(*a, exact_bwd=False, **k), h)
    ms, first, sp = _median_ms(ffb, (srcs, q, g, dy))
    row("triton-1p", "fwd+bwd", ms, first, sp, b["k_fb_fast"], b["min_fb"])
  if with_ref:
    rf, rfb = fns(reference.route, h)
    ms, first, sp = _median_ms(rf, (srcs, q, g))
    row("reference", "fwd", ms, first, sp, None, b["min_fwd"])
    ms, first, sp = _median_ms(rfb, (srcs, q, g, dy))
    row("reference", "fwd+bwd", ms, first, sp, None, b["min_fb"])
    if check:
      o1, (ds1, dq1, _) = tfb(srcs, q, g, dy)
      o2, (ds2, dq2, _) = rfb(srcs, q, g, dy)
      errs = dict(out=rel(o1, o2), dquery=rel(dq1, dq2),
                  dsrc=max(rel(a, b_) for a, b_ in zip(ds1, ds2)))
      print(f"  check vs reference: {errs}", flush=True)
      for r in rows:
        r["check"] = errs
  return rows


def bench_sites(tr, n, s, d, h, dtype, sites, copy_gbs):
  """G sites over the same S sources: G launches vs one G-site launch."""
  srcs, _, _, _ = make_inputs(n, s, d, dtype, seed=n + s + sites)
  t = jax.random.normal(jax.random.PRNGKey(s), (sites, d)) * 0.3
  cfg = tr._make_cfg(d, h, 1e-6, True, None, ())
  e = n * d * jnp.dtype(dtype).itemsize
  sep = jax.jit(lambda srcs, t: [tr._fwd_impl(srcs, t[k:k + 1], cfg)
                                 for k in range(sites)])
  grp = jax.jit(lambda srcs, t: tr._fwd_impl(srcs, t, cfg))
  a = sep(srcs, t)
  b = grp(srcs, t)
  err = max(float(jnp.max(jnp.abs(a[k][0][0].astype(jnp.float32)
                                  - b[0][k].astype(jnp.float32))))
            for k in range(sites))
  rows = []
  for name, fn in (("separate", sep), ("grouped", grp)):
    ms, first, spread = _median_ms(fn, (srcs, t))
    unique = (s + sites) * e
    rows.append(dict(N=n, S=s, D=d, H=h, G=sites, what=f"sites-{name}",
                     ms=ms, compile_s=first, ms_min=spread[0],
                     ms_max=spread[1], unique_bytes=unique,
                     pct_copy_unique=100 * unique / (ms * 1e-3) / 1e9
                     / copy_gbs, max_abs_diff=err))
    print(f"  {sites} sites {name:8s} N={n} S={s}: {ms:8.3f} ms (compile+"
          f"first {first:5.1f} s); unique bytes at "
          f"{rows[-1]['pct_copy_unique']:5.1f}% copy", flush=True)
  print(f"  grouped / separate: {rows[1]['ms'] / rows[0]['ms']:.3f};"
        f" max |grouped - separate| = {err:.3g}", flush=True)
  return rows


def _time_config(tr, what, over, srcs, q, g, dy, h, e, n, d, s, copy_gbs):
  tr.TUNING.update(over)
  try:
    f, fb = fns(lambda *a, **k: tr.route(*a, **k), h)
    carry = 8 * n * d * (math.ceil(s / tr.CHUNK) - 1)
    if what == "fwd":
      ms, first, _ = _median_ms(f, (srcs, q, g), reps=7)
      moved = (s + 1) * e + carry
    else:
      ms, first, _ = _median_ms(fb, (srcs, q, g, dy), reps=7)
      moved = (s + 1) * e + carry + (3 * s + 2) * e
    gbs = moved / (ms * 1e-3) / 1e9
    rec = dict(what=what, over=over, ms=ms, compile_s=first, gbs_moved=gbs,
               pct_copy=100 * gbs / copy_gbs)
    print(f"  sweep {what:3s} {over}: {ms:.3f} ms, {gbs:.0f} GB/s moved = "
          f"{rec['pct_copy']:.1f}% copy (compile {first:.1f} s)", flush=True)
  except Exception as ex:  # noqa: BLE001
    rec = dict(what=what, over=over, error=repr(ex)[:300])
    print(f"  sweep {what} {over}: ERROR {rec['error']}", flush=True)
  return rec


def sweep(tr, n, s, d, h, dtype, copy_gbs, apply_best=True):
  """Times the forward, then fwd+bwd, over tile/prefetch configurations.

  The forward's best (also used for the backward's c-pass, a similar
  streaming kernel) is kept while the backward is swept; with
  ``apply_best`` the best of each is left in ``tr.TUNING``.
  """
  base = dict(tr.TUNING)
  srcs, q, g, dy = make_inputs(n, s, d, dtype, seed=7)
  e = n * d * jnp.dtype(dtype).itemsize
  out = []
  fwd_cfgs = [dict(fwd_elems_per_thread=ept, fwd_warps=w, fwd_prefetch=pf)
              for ept, w, pf in [(16, 4, 1), (16, 4, 2), (16, 4, 3),
                                 (16, 4, 4), (16, 8, 3), (32, 4, 2),
                                 (32, 4, 4), (16, 2, 4), (32, 8, 4)]]
  best = None
  for over in fwd_cfgs:
    tr.TUNING = dict(base)
    rec = _time_config(tr, "fwd", over, srcs, q, g, dy, h, e, n, d, s,
                       copy_gbs)
    out.append(rec)
    if "ms" in rec and (best is None or rec["ms"] < best["ms"]):
      best = rec
  fwd_best = dict(base)
  if best:
    o = best["over"]
    fwd_best.update(o, cpass_elems_per_thread=o["fwd_elems_per_thread"],
                    cpass_warps=o["fwd_warps"],
                    cpass_prefetch=o["fwd_prefetch"])
  bwd_cfgs = [dict(bwd_elems_per_thread=ept, bwd_warps=w, bwd_prefetch=pf,
                   bwd_programs_per_sm=pps)
              for ept, w, pf, pps in [(16, 4, 1, 4), (16, 4, 2, 4),
                                      (16, 4, 3, 4), (16, 4, 2, 8),
                                      (16, 8, 2, 2), (8, 2, 2, 8),
                                      (32, 4, 2, 8), (32, 4, 1, 8),
                                      (16, 2, 2, 8)]]
  best = None
  for over in bwd_cfgs:
    tr.TUNING = dict(fwd_best)
    rec = _time_config(tr, "fb", over, srcs, q, g, dy, h, e, n, d, s,
                       copy_gbs)
    out.append(rec)
    if "ms" in rec and (best is None or rec["ms"] < best["ms"]):
      best = rec
  final = dict(fwd_best)
  if best:
    final.update(best["over"])
  tr.TUNING = final if apply_best else base
  print(f"  sweep -> TUNING = {tr.TUNING}", flush=True)
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--sizes", default=None,
                 help="comma list of NxS, e.g. 32768x37,16384x8")
  p.add_argument("--d", type=int, default=1280)
  p.add_argument("--h", type=int, default=8)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--sweep", action="store_true")
  p.add_argument("--sweep-size", default="32768x37")
  p.add_argument("--no-ref", action="store_true")
  p.add_argument("--pin-compare", default=None,
                 help="NxS: time fwd and fwd+bwd with PIN_ACCUMULATORS off/on")
  p.add_argument("--no-fast", action="store_true")
  p.add_argument("--given-r", action="store_true",
                 help="also time the forward reading each source's inverse "
                 "RMS (as routed_stack calls it) instead of computing it")
  p.add_argument("--tuning", default=None,
                 help="JSON dict merged into triton_route.TUNING")
  p.add_argument("--chunk", type=int, default=None)
  p.add_argument("--json", default=None)
  p.add_argument("--copy-mib", type=int, default=2048)
  p.add_argument("--sites", type=int, default=0,
                 help="also time G sites over the same sources (see above)")
  args = p.parse_args()

  from mhar_jax.kernels import triton_route as tr
  if args.tuning:
    tr.TUNING.update(json.loads(args.tuning))
  if args.chunk:
    tr.CHUNK = args.chunk
  dtype = jnp.dtype(args.dtype)
  dev = jax.devices()[0]
  print(f"device: {dev.device_kind} ({jax.default_backend()}), jax "
        f"{jax.__version__}, sms={getattr(dev, 'core_count', '?')}", flush=True)
  cb = copy_bandwidth(args.copy_mib)
  copy_gbs = max(v for k, v in cb.items() if isinstance(v, float))
  print(f"copy bandwidth: {cb} -> using {copy_gbs:.0f} GB/s", flush=True)
  result = dict(device=dev.device_kind, copy=cb, copy_gbs=copy_gbs,
                tuning=dict(tr.TUNING), chunk=tr.CHUNK, rows=[], sweep=None)
  if args.sweep:
    n, s = map(int, args.sweep_size.split("x"))
    print(f"sweep at N={n} S={s}:", flush=True)
    result["sweep"] = sweep(tr, n, s, args.d, args.h, dtype, copy_gbs)
    result["tuning"] = dict(tr.TUNING)
  if args.pin_compare:
    n, s = map(int, args.pin_compare.split("x"))
    srcs, q, g, dy = make_inputs(n, s, args.d, dtype, seed=11)
    e = n * args.d * dtype.itemsize
    result["pin_compare"] = []
    pin0 = tr.PIN_ACCUMULATORS
    for pin in (False, True):
      tr.PIN_ACCUMULATORS = pin
      for what in ("fwd", "fb"):
        rec = _time_config(tr, what, {}, srcs, q, g, dy, args.h, e, n, args.d,
                           s, copy_gbs)
        rec["pin"] = pin
        print(f"    (pin={pin})", flush=True)
        result["pin_compare"].append(rec)
    tr.PIN_ACCUMULATORS = pin0
    del srcs, dy
  sizes = DEFAULT_SIZES if not args.sizes else [
      tuple(map(int, x.split("x"))) for x in args.sizes.split(",")]
  for n, s in sizes:
    print(f"size N={n} S={s} D={args.d} H={args.h} {dtype.name}:", flush=True)
    try:
      result["rows"] += bench_size(tr, n, s, args.d, args.h, dtype, copy_gbs,
                                   with_ref=not args.no_ref,
                                   with_fast=not args.no_fast,
                                   with_r=args.given_r)
    except Exception as ex:  # noqa: BLE001
      print(f"  ERROR {ex!r}"[:500], flush=True)
    if args.sites:
      result.setdefault("sites", []).extend(
          bench_sites(tr, n, s, args.d, args.h, dtype, args.sites, copy_gbs))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)

  print(f"\nrouting on {dev.device_kind}, D={args.d} H={args.h} {dtype.name}, "
        f"copy {copy_gbs:.0f} GB/s; %copy of min bytes (kernel: of moved "
        "bytes)")
  print(f"{'N':>6} {'S':>3} {'what':8} {'ref ms':>8} {'tri ms':>8} "
        f"{'1p ms':>8} {'speedup':>7} {'ref %':>6} {'tri %':>6} "
        f"{'tri mv%':>7}")
  key = lambda r: (r["N"], r["S"], r["what"])  # noqa: E731
  rows = sorted(result["rows"], key=key)
  for k, grp in itertools.groupby(rows, key=key):
    by = {r["impl"]: r for r in grp}
    ref, tri, fast = by.get("reference"), by.get("triton"), by.get("triton-1p")
    f = lambda r, x, fmt: format(r[x], fmt) if r and r.get(x) else "-"  # noqa
    sp = (f"{ref['ms'] / tri['ms']:.2f}x" if ref and tri else "-")
    print(f"{k[0]:>6} {k[1]:>3} {k[2]:8} {f(ref, 'ms', '8.3f'):>8} "
          f"{f(tri, 'ms', '8.3f'):>8} {f(fast, 'ms', '8.3f'):>8} {sp:>7} "
          f"{f(ref, 'pct_copy_min', '6.1f'):>6} "
          f"{f(tri, 'pct_copy_min', '6.1f'):>6} "
          f"{f(tri, 'pct_copy_moved', '7.1f'):>7}")


if __name__ == "__main__":
  main()
