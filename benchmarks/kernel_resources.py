"""What Triton makes of the tensor-core routing kernels for the H200, without a GPU.

    python benchmarks/kernel_resources.py [--d 1280 --h 8] \
        [--variants 0x4x3,1x4x3,1x1x3]

Compiles ``triton_stack.sites_kernel`` and ``sources_kernel`` (both loop
forms, ``FLAT``) and ``query_gain_grad_kernel`` (16 sites) for sm_90 as jax-triton would launch them at width ``D``
with ``H`` heads, bf16, 16 rows, the tokens a program of ``SITES_TUNING`` /
``SOURCES_TUNING``, for each variant (loop form x warps x pipeline stages),
and prints the registers a thread, spilled bytes (``ptxas -v``), shared
memory, the asynchronous copies in the code (``cp.async``: loads the
software pipeline issues ahead), its barriers (``bar.sync``) and how many
programs an SM could hold. Needs only ``triton`` (its bundled ``ptxas``); no CUDA
driver or device. It tells whether a variant compiles, fits and is
pipelined, not how fast it runs: time that on the device
(``benchmarks/depth_attention.py``, ``benchmarks/source_grad.py --group``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def compile_stats(kernel, types: dict, constexprs: dict, warps: int) -> dict:
  """Compiles ``kernel`` for sm_90 with argument ``types`` (name -> Triton
  type string, pointers 16-byte aligned as jax-triton assumes) and
  ``constexprs``; returns registers, spill bytes, shared bytes and the count
  of ``cp.async`` and ``bar.sync`` instructions in the code."""
  import triton
  from triton import knobs
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource
  if not knobs.cache.dir:          # unset once jax_triton is imported
    knobs.cache.dir = tempfile.mkdtemp(prefix="triton-cache-")
  sig = {name: types.get(name, "constexpr") for name in kernel.arg_names}
  attrs = {(i,): [["tt.divisibility", 16]]
           for i, name in enumerate(kernel.arg_names)
           if sig[name].startswith("*")}
  src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs,
                  attrs=attrs)
  k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                     options={"num_warps": warps, "num_stages": 1})
  ptx = k.asm["ptx"]
  ptxas = os.path.join(os.path.dirname(triton.__file__), "backends",
                       "nvidia", "bin", "ptxas")
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "k.ptx")
    with open(path, "w") as f:
      f.write(ptx)
    out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o",
                          os.path.join(tmp, "k.cubin")], capture_output=True,
                         text=True, check=True).stderr
  regs = int(re.search(r"Used (\d+) registers", out).group(1))
  spill = sum(int(x) for x in re.findall(r"(\d+) bytes spill", out))
  return dict(regs=regs, spill=spill, shared=k.metadata.shared,
              cp_async=len(re.findall(r"cp\.async\.(?:ca|cg)", ptx)),
              bar_sync=len(re.findall(r"\bbar\.sync\b", ptx)))


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--d", type=int, default=1280)
  ap.add_argument("--h", type=int, default=8)
  ap.add_argument("--variants", default="0x4x3,1x4x3",
                  help="FLAT (0/1) x warps x pipeline stages, comma-separated")
  a = ap.parse_args()
  from mhar_jax.kernels import triton_stack as ts
  from mhar_jax.kernels.triton_route import head_parts
  c = a.d // a.h
  ca, cb = head_parts(c)
  shape = dict(D=a.d, H=a.h, C=c, CA=ca, CB=cb, G=16, LOWP=True)
  p16, p32 = "*bf16", "*fp32"
  rows = []
  for name, kernel, tu, types, meta in (
      ("sites_kernel", ts.sites_kernel, ts.SITES_TUNING,
       dict(x_ptr=p16, r_ptr=p32, t_ptr=p32, out_init=p16, lse_init=p32,
            S="i32", GV="i32", N="i32", out_ptr=p16, lse_ptr=p32),
       dict(SB=ts.SITES_TUNING["source_block"], EVEN_S=True)),
      ("sources_kernel", ts.sources_kernel, ts.SOURCES_TUNING,
       dict(s_ptr=p16, r_ptr=p32, dx_ptr=p16, t_ptr=p16, tlo_ptr=p16,
            lse_ptr=p32, xd_ptr=p32, acc_in=p16, coef_in=p32, acc_init=p16,
            coef_init=p32, dlr_init=p32, I0="i32", GV="i32", J0="i32",
            JX="i32", M="i32", N="i32", acc_ptr=p16, coef_ptr=p32,
            dlr_ptr=p32),
       dict(MB=ts.SOURCES_TUNING["site_block"], EVEN_M=True, INIT=True))):
    for v in a.variants.split(","):
      flat, warps, stages = map(int, v.split("x"))
      st = compile_stats(kernel, types, dict(
          shape, **meta, BT=int(tu["tokens_per_program"]), STAGES=stages,
          FLAT=bool(flat)), warps)
      rows.append((name, "flat" if flat else "per token", warps, stages, st))
  qt = ts.QGRAD_TUNING
  st = compile_stats(
      ts.query_gain_grad_kernel,
      dict(d_ptr=p32, s_ptr=p16, out_init=p32, K="i32", M="i32", SK="i32",
           SM="i32", SH="i32", S0="i64", KC="i32", out_ptr=p32),
      dict(D=a.d, C=c, BC=ts._channel_block(c), MB=16,
           BK=int(qt["tokens_a_step"]), STAGES=int(qt["stages"]), LOWP=True),
      int(qt["warps"]))
  rows.append(("query_gain_grad", "-", int(qt["warps"]), int(qt["stages"]),
               st))
  print(f"sm_90, D={a.d} H={a.h} (C = {ca} + {cb}), bf16, G=16; programs an "
        "SM: as registers and shared memory allow (65,536 registers, 227 KiB)")
  print(f"{'kernel':16s} {'loop':10s} {'warps':>5s} {'stages':>6s} "
        f"{'regs':>5s} {'spill B':>7s} {'smem B':>7s} {'cp.async':>8s} "
        f"{'bar.sync':>8s} {'progs/SM':>8s}")
  for name, loop, warps, stages, st in rows:
    progs = min(65536 // (st["regs"] * 32 * warps),
                227 * 1024 // max(st["shared"], 1), 64 // warps, 32)
    print(f"{name:16s} {loop:10s} {warps:5d} {stages:6d} {st['regs']:5d} "
          f"{st['spill']:7d} {st['shared']:7d} {st['cp_async']:8d} "
          f"{st['bar_sync']:8d} {progs:8d}")


if __name__ == "__main__":
  main()
