"""The training backward's kernel alone: one source's gradient from M sites.

    python3 benchmarks/source_grad.py --d 1280 --m 37 \
        --tunings '[{}, {"stages": 3}, {"elems_per_thread": 24, "warps": 8}]'

Times :func:`mhar_jax.kernels.triton_stack.source_grad_local` (the kernel and
the query-gain gradient's product, what ``routed_stack``'s
backward runs once per source) at ``N`` tokens x ``D``, H heads, bf16, with
``M`` sites reading the source (``--ms 1,4,16``: each count in turn), under
each tuning of ``triton_stack.TUNING`` given (one JSON dict each, merged into
the defaults); ``--init``: continuing a share of later sites ``(acc, coef)``,
as the grouped backward's calls do (at 1b: 1 to 16 sites each). Each is
checked against the jnp reference (``stack.source_grad``) on the same inputs
first. Printed per tuning: tokens a program, ms (median), and the bytes any
implementation must move (``s`` read twice, every ``dx_j`` read, ``lse``,
``xd`` read, ``ds`` written, ``dlr`` written and read, the share read) per
second, as a share of a copy bandwidth measured in the same run.

With ``--group G`` it times instead the share of the M sites in the
gradients of G sources at once on tensor cores
(:func:`~mhar_jax.kernels.triton_stack.sources_partial_local`, the grouped
backward's first phase) under each tuning of ``triton_stack.SOURCES_TUNING``
in ``--tunings``, against G launches of ``source_grad_local`` over the same
sites (the ungrouped backward's work for them), each checked against its jnp
reference (``stack.sources_partial`` / ``stack.source_grad``).

With ``--qgrad`` it times the query-gain gradient's product alone
(:func:`~mhar_jax.kernels.triton_stack.query_gain_grad`, ``dt[m, c] = sum_n
dlr[n, m, h(c)] s[n, c]``) under each tuning of ``triton_stack.QGRAD_TUNING``
in ``--tunings``, against XLA's product of the same arrays (the einsum the
kernels' callers compute where ``triton_stack.qgrad_supported`` is false;
it reads these standalone arrays without a copy): one source's N tokens
with ``dlr`` as ``source_grad_kernel`` writes it (``[M, H, N]``), or with
``--group G`` G sources' rows with ``dlr`` as ``sources_kernel`` writes it
(``[G, N, H, MP]``, sites padded to whole blocks; XLA gets the M sites as
an array of their own). Printed: ms and the bytes read (the rows and
``dlr``'s M sites once) a second as a share of copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mhar_jax.kernels import stack  # noqa: E402
from routing import _median_ms, copy_bandwidth  # noqa: E402


def inputs(n, m, d, h, seed=0):
  ks = jax.random.split(jax.random.key(seed), 6)
  s = (jax.random.normal(ks[0], (n, d)) * 1.5).astype(jnp.bfloat16)
  r = jax.lax.rsqrt(jnp.mean(jnp.square(s.astype(jnp.float32)), -1) + 1e-6)
  dx = jax.random.normal(ks[1], (m, n, d), jnp.bfloat16)
  t = 0.3 * jax.random.normal(ks[2], (m, d)) / np.sqrt(d / h)
  lse = 1.0 + 0.1 * jax.random.normal(ks[3], (m, n, h))
  xd = 0.1 * jax.random.normal(ks[4], (m, n, h))
  return s, r, dx, t, lse, xd


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--n", type=int, default=32768)
  ap.add_argument("--d", type=int, default=1280)
  ap.add_argument("--h", type=int, default=8)
  ap.add_argument("--m", type=int, default=37)
  ap.add_argument("--tunings", default="[{}]",
                  help="JSON list of dicts merged into triton_stack.TUNING")
  ap.add_argument("--group", type=int, default=0,
                  help="time G sources at once on tensor cores (--tunings "
                  "then tune triton_stack.SOURCES_TUNING)")
  ap.add_argument("--qgrad", action="store_true",
                  help="time the query-gain product alone (--tunings then "
                  "tune triton_stack.QGRAD_TUNING)")
  ap.add_argument("--ms", default="",
                  help="comma-separated site counts to time in turn instead "
                  "of --m (one source's gradient)")
  ap.add_argument("--init", action="store_true",
                  help="one source's gradient continuing a share of later "
                  "sites (acc, coef), as the grouped backward's calls do")
  ap.add_argument("--json", default="")
  a = ap.parse_args()
  if a.qgrad:
    return qgrad(a)
  if a.group:
    return group(a)
  from mhar_jax.kernels import triton_stack as ts   # needs a GPU jaxlib
  default = dict(ts.TUNING)
  dev = jax.devices()[0]
  cb = copy_bandwidth()
  copy_gbs = max(v for v in cb.values() if isinstance(v, float))
  print(f"{dev.device_kind}: copy {copy_gbs:.0f} GB/s; N={a.n} D={a.d} "
        f"H={a.h} bf16{', with a share of later sites' if a.init else ''}",
        flush=True)
  e = a.n * a.d * 2
  rows = []
  for m in [int(x) for x in a.ms.split(",")] if a.ms else [a.m]:
    args = inputs(a.n, m, a.d, a.h)
    init = None
    if a.init:
      ks = jax.random.split(jax.random.key(m), 2)
      init = (jax.random.normal(ks[0], (a.n, a.d), jnp.bfloat16),
              jax.random.normal(ks[1], (a.n, a.h)))
    ref = jax.jit(lambda init, *x, m=m: stack.source_grad(
        *x, 0, a.h, m, init))(init, *args)
    nbytes = ((m + 3 + a.init) * e + 4 * a.n * a.h * m * 4 + 4 * a.n
              + a.init * a.n * a.h * 4)
    for tu in json.loads(a.tunings):
      ts.TUNING.clear()
      ts.TUNING.update(default, **tu)
      fn = jax.jit(lambda init, *x, m=m: ts.source_grad_local(
          *x, 0, a.h, m, init))
      try:
        err = _rel(fn(init, *args), ref)
        ms, first, _ = _median_ms(fn, (init, *args))
      except Exception as ex:  # noqa: BLE001
        print(f"M={m} {json.dumps(tu)}: ERROR {ex!r}"[:400], flush=True)
        continue
      pct = 100 * nbytes / (ms * 1e-3) / 1e9 / copy_gbs
      rows.append(dict(m=m, init=a.init, tuning=dict(ts.TUNING),
                       bn=ts.tokens_per_program(a.d, a.h), ms=ms,
                       pct_copy=pct, rel_err=err, compile_s=first))
      print(f"M={m:3d} {json.dumps(tu):46s} BN {rows[-1]['bn']:2d} {ms:8.3f} "
            f"ms {pct:5.1f}% copy  rel err {err:.1e}", flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(dict(device=dev.device_kind, copy=cb, n=a.n, d=a.d, h=a.h,
                     rows=rows), f, indent=1)


def _rel(out, ref):
  return max(float(jnp.max(jnp.abs(o.astype(jnp.float32)
                                   - w.astype(jnp.float32)))
                   / jnp.max(jnp.abs(w.astype(jnp.float32))))
             for o, w in zip(out, ref))


def group(a):
  """``--group G``: see the module docstring."""
  from mhar_jax.kernels import triton_stack as ts   # needs a GPU jaxlib
  default = dict(ts.SOURCES_TUNING)
  dev = jax.devices()[0]
  print(f"{dev.device_kind}: N={a.n} D={a.d} H={a.h} M={a.m} G={a.group} "
        "bf16", flush=True)
  # One set of site arrays; each source's own (its M-row dx unused: at M 48
  # the G copies alone would not fit an H100).
  dx, t, lse, xd = inputs(a.n, a.m, a.d, a.h)[2:]
  srcs = [inputs(a.n, 1, a.d, a.h, seed=g)[:2] for g in range(a.group)]
  buf = jnp.stack([x[0] for x in srcs])
  r = jnp.stack([x[1] for x in srcs])
  lse = jnp.maximum(lse, 3.0)      # w <= 1 for every source here
  args = (buf, r, dx, t, lse, xd)
  per = jax.jit(lambda buf, r, *x: [
      ts.source_grad_local(buf[g], r[g], *x, 0, a.h) for g in range(a.group)])
  ref = jax.jit(lambda buf, r, *x: [
      stack.source_grad(buf[g], r[g], *x, 0, a.h) for g in range(a.group)])(
          *args)
  err = max(_rel(o, w) for o, w in zip(per(*args), ref))
  base, _, _ = _median_ms(per, args)
  print(f"{a.group} source_grad launches: {base:8.3f} ms  rel err {err:.1e}",
        flush=True)
  want = jax.jit(lambda *x: stack.sources_partial(*x, 0, a.m, a.h))(*args)
  rows = [dict(what="source_grad x G", ms=base, rel_err=err)]
  for tu in json.loads(a.tunings):
    ts.SOURCES_TUNING.clear()
    ts.SOURCES_TUNING.update(default, **tu)
    fn = jax.jit(lambda buf, r, *x: ts.sources_partial_local(
        buf, 0, a.group, r, *x, 0, a.m, a.h))
    try:
      err = _rel(fn(*args), want)
      ms, first, _ = _median_ms(fn, args)
    except Exception as ex:  # noqa: BLE001
      print(f"{json.dumps(tu)}: ERROR {ex!r}"[:400], flush=True)
      continue
    rows.append(dict(what="sources_partial", tuning=dict(ts.SOURCES_TUNING),
                     ms=ms, rel_err=err, compile_s=first))
    print(f"sources_partial {json.dumps(tu):40s} {ms:8.3f} ms "
          f"({ms / base:.3f}x)  rel err {err:.1e}", flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(dict(device=dev.device_kind, n=a.n, d=a.d, h=a.h, m=a.m,
                     group=a.group, rows=rows), f, indent=1)


def qgrad(a):
  """``--qgrad``: see the module docstring."""
  from mhar_jax.kernels import triton_stack as ts   # needs a GPU jaxlib
  default = dict(ts.QGRAD_TUNING)
  dev = jax.devices()[0]
  cb = copy_bandwidth()
  copy_gbs = max(v for v in cb.values() if isinstance(v, float))
  g, n, m, d, h = max(a.group, 1), a.n, a.m, a.d, a.h
  c = d // h
  print(f"{dev.device_kind}: copy {copy_gbs:.0f} GB/s; query-gain product, "
        f"{g} source row(s) of N={n} D={d} H={h}, M={m} sites, bf16",
        flush=True)
  ks = jax.random.split(jax.random.key(0), 2)
  S = jax.random.normal(ks[0], (g, n, d), jnp.bfloat16)
  if a.group:            # sources_kernel's layout [G, N, H, MP], padded
    mp = ts.sources_dlr_sites(m)
    dlr = jax.random.normal(ks[1], (g, n, h, mp))
    strides, k = (h * mp, 1, mp), g * n
    xla_args = (dlr[..., :m], S)       # XLA's operand unpadded: no slice
    xla = jax.jit(lambda dlr, S: jnp.einsum(
        "gnhm,gnhc->mhc", dlr, S.astype(jnp.float32).reshape(g, n, h, c),
        precision=jax.lax.Precision.HIGHEST)
        .reshape(m, d))
  else:                  # source_grad_kernel's layout [M, H, N]
    dlr = jax.random.normal(ks[1], (m, h, n))
    strides, k = (1, h * n, n), n
    xla_args = (dlr, S)
    xla = jax.jit(lambda dlr, S: jnp.einsum(
        "mhn,nhc->mhc", dlr, S[0].astype(jnp.float32).reshape(n, h, c),
        precision=jax.lax.Precision.HIGHEST)
        .reshape(m, d))
  args = (dlr, S)
  want = xla(*xla_args)
  base, _, _ = _median_ms(xla, xla_args)
  nbytes = g * n * d * 2 + g * n * h * m * 4
  pct = lambda ms: 100 * nbytes / (ms * 1e-3) / 1e9 / copy_gbs  # noqa: E731
  print(f"XLA einsum {'':38s} {base:8.3f} ms {pct(base):5.1f}% copy",
        flush=True)
  rows = [dict(what="xla", ms=base, pct_copy=pct(base))]
  for tu in json.loads(a.tunings):
    ts.QGRAD_TUNING.clear()
    ts.QGRAD_TUNING.update(default, **tu)
    fn = jax.jit(lambda dlr, S: ts.query_gain_grad(dlr, strides, S, 0, k, m,
                                                   h))
    try:
      err = _rel([fn(*args)], [want])
      ms, first, _ = _median_ms(fn, args)
    except Exception as ex:  # noqa: BLE001
      print(f"{json.dumps(tu)}: ERROR {ex!r}"[:400], flush=True)
      continue
    rows.append(dict(what="query_gain_grad", tuning=dict(ts.QGRAD_TUNING),
                     ms=ms, pct_copy=pct(ms), rel_err=err, compile_s=first))
    print(f"query_gain_grad {json.dumps(tu):32s} {ms:8.3f} ms "
          f"{pct(ms):5.1f}% copy ({ms / base:.3f}x XLA)  rel err {err:.1e}",
          flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(dict(device=dev.device_kind, copy=cb, n=n, d=d, h=h, m=m,
                     group=a.group, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
