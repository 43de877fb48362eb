"""Compiles the routing kernels for an H100/H200 (sm_90) without a GPU and
reports what each costs the hardware: registers a thread, shared memory,
barriers and layout conversions (per kernel, all sources unrolled), vector
global loads, SASS instructions (all, those of the largest loop body: the
source-major backward's loop over sites, and every loop body's size: the
tensor-core kernels' inner loop over a block of sites or sources is the
smaller of two).

Registers bound occupancy (65,536 a multiprocessor: 128 threads at 103
registers leave room for 4 programs, 16 warps); barriers and layout
conversions are the shared-memory round trips that Nsight Compute reports as
"short scoreboard" stalls (benchmarks/RESULTS.md, session 10). Instructions a
loop iteration (per thread, per site) bound a kernel that issue slots limit:
the source-major backward at ~63% of copy bandwidth issued ~1.3x the
instructions per byte of the forward at ~90% (session 11). Use the Triton
of the GPU machine (3.6.0 in `/work/.library/env`; `pip install triton==3.6.0`
beside jax) for figures that match it. Pointers are marked 16-byte aligned,
as jax-triton marks them. jax-triton (0.3.1) specialises a runtime int only
when it equals 1 (to a constexpr; ``--ones``), never by divisibility, so plain
i32 scalars and ``--ones`` are the two forms it compiles::

    python tools/kernel_resources.py                       # D 1280, H 8
    python tools/kernel_resources.py --d 1024 --pf 2 --warps 8
    python tools/kernel_resources.py --kernels sources --opcodes 12   # + loop opcodes
    python tools/kernel_resources.py --kernels sites,sources \
        --sites_tuning '{"warps": 2}' --sources_tuning '{"stages": 2}'
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# triton_route imports jax_triton, which needs a GPU jaxlib; compiling does not.
sys.modules.setdefault("jax_triton", types.ModuleType("jax_triton"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mhar_jax.kernels import triton_route as tr  # noqa: E402
from mhar_jax.kernels import triton_stack as ts  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia",
                   "bin")
K = tr.MAX_SOURCES_PER_LAUNCH
SLOTS = lambda p: {f"{p}{i}" for i in range(K)}  # noqa: E731
# Pointer arguments in the sources' dtype (bf16); every other pointer is fp32.
BF16 = {"fwd": SLOTS("s") | {"out_ptr", "i_out"},
        "cpass": SLOTS("s") | {"g_ptr"},
        "bwd": SLOTS("s") | SLOTS("ds") | SLOTS("i") | {"g_ptr"},
        "source_grad": {"s_ptr", "dx_ptr", "ds_ptr"},
        "norm_grad": {"x_ptr", "dy_ptr", "dy1_ptr", "dy2_ptr", "buf_in",
                      "buf_ptr"}}
SCALARS = {"N", "I0", "NTILES", "I", "M", "S", "GV", "J0", "IX", "IS", "IA",
           "JX", "K", "SK", "SM", "SH", "KC", "ROW", "MP", "JX1", "JX2", "JX3",
           "K1", "K2", "K3", "OUT_ROW", "X_ROW"}


def compile_kernel(fn, bf16, constexprs, warps):
  """``fn`` compiled for sm_90: ``(CompiledKernel, resource line)``."""
  names = list(fn.arg_names)
  sig, attrs = {}, {}
  for i, n in enumerate(names):
    if n in constexprs:
      sig[n] = "constexpr"
    elif n in SCALARS:
      sig[n] = "i32"
    else:
      sig[n] = "*bf16" if n in bf16 else "*fp32"
      attrs[(i,)] = [["tt.divisibility", 16]]
  src = ASTSource(fn, sig, attrs=attrs, constexprs={
      (names.index(c),): v for c, v in constexprs.items()})
  cc = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                      options=dict(num_warps=warps, num_stages=1))
  with tempfile.TemporaryDirectory() as td:
    path = os.path.join(td, "k.cubin")
    with open(path, "wb") as f:
      f.write(cc.asm["cubin"])
    usage = subprocess.run([os.path.join(BIN, "cuobjdump"),
                            "--dump-resource-usage", path],
                           capture_output=True, text=True, check=True).stdout
    sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", path],
                          capture_output=True, text=True, check=True).stdout
  return cc, usage, sass


def sass_loops(sass):
  """``(instructions, loop bodies)`` of a kernel's SASS: each instruction an
  opcode with operands, each loop body the instructions from a label to a
  branch back to it (nested loops appear inside their outer loop's body)."""
  label_at, pending, insts = {}, [], []
  for line in sass.splitlines():
    m = re.match(r"\s*\.(L_x_\d+):", line)
    if m:
      pending.append(m.group(1))
      continue
    m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
    if m:
      addr = int(m.group(1), 16)
      label_at.update((p, addr) for p in pending)
      pending = []
      insts.append((addr, m.group(2)))
  loops = []
  for addr, ins in insts:
    m = re.search(r"BRA.*`\(\.(L_x_\d+)\)", ins)
    if m and label_at.get(m.group(1), addr) < addr:
      start = label_at[m.group(1)]
      loops.append([i for a, i in insts if start <= a <= addr])
  return [i for _, i in insts], loops


def opcodes(insts, top=12):
  """The ``top`` most frequent opcodes (predicate and modifiers stripped)."""
  ops = collections.Counter(
      re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0]
      for i in insts)
  return dict(ops.most_common(top))


def report(name, cc, usage, sass, warps, top=0):
  ptx, ttgir = cc.asm["ptx"], cc.asm["ttgir"]
  insts, loops = sass_loops(sass)
  loop = max(loops, key=len, default=[])
  regs = int(re.search(r"REG:(\d+)", usage).group(1))
  stack = int(re.search(r"STACK:(\d+)", usage).group(1))
  programs = min(32, 65536 // (regs * 32 * warps), 64 // warps)
  return dict(kernel=name, regs=regs, stack_bytes=stack,
              programs_per_sm=programs,
              warps_per_sm=programs * warps, shared=cc.metadata.shared,
              barriers=ptx.count("bar.sync") + ptx.count("barrier.sync"),
              layout_conversions=ttgir.count("ttg.convert_layout"),
              vector_loads=len(re.findall(r"ld\.global[.a-z0-9]*\.v\d", ptx)),
              async_copies=len(re.findall(r"cp\.async\.(?:ca|cg)", ptx)),
              loads=ptx.count("ld.global"), sass=len(insts),
              loop_sass=len(loop), loops=sorted(map(len, loops)),
              **({"loop_opcodes": opcodes(loop, top)} if top else {}))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--d", type=int, default=1280)
  ap.add_argument("--h", type=int, default=8)
  ap.add_argument("--nsrc", type=int, default=K)
  ap.add_argument("--pf", type=int, default=tr.TUNING["fwd_prefetch"])
  ap.add_argument("--warps", type=int, default=tr.TUNING["fwd_warps"])
  ap.add_argument("--kernels",
                  default="fwd,fwd_r,cpass,cpass_r,bwd,bwd_r,source_grad",
                  help="of fwd, fwd_r, cpass, cpass_r, bwd, bwd_r, "
                  "source_grad, source_grad_init, sites, sources, "
                  "sources_4buffers, "
                  "query_gain_grad, norm_grad, norm_grad_3dy (dy as 3 "
                  "terms)")
  ap.add_argument("--source_grad_tuning", default="",
                  help="JSON dict merged into triton_stack.TUNING")
  ap.add_argument("--sources_tuning", default="",
                  help="JSON dict merged into triton_stack.SOURCES_TUNING")
  ap.add_argument("--sites_tuning", default="",
                  help="JSON dict merged into triton_stack.SITES_TUNING")
  ap.add_argument("--qgrad_tuning", default="",
                  help="JSON dict merged into triton_stack.QGRAD_TUNING")
  ap.add_argument("--norm_tuning", default="",
                  help="JSON dict merged into triton_stack.NORM_TUNING")
  ap.add_argument("--qgrad_sites", type=int, default=16,
                  help="query_gain_grad: the sites it is compiled for (its "
                  "site block and, by default, warps and tokens a step)")
  ap.add_argument("--qgrad_unit", type=int, default=1, choices=(1, 2),
                  help="query_gain_grad: 1 compiles dlr as source_grad writes "
                  "it (tokens contiguous), 2 as sources_kernel does (sites,"
                  " padded to whole site blocks)")
  ap.add_argument("--ones", action="store_true",
                  help="compile with every runtime int equal to 1, which "
                  "Triton specialises to a constexpr (code that calls "
                  "methods on such an argument fails only then)")
  ap.add_argument("--even_sites", type=int, default=1,
                  help="sites / sources kernels: 1 compiles the variant for a"
                  " source / site count that is a multiple of the block"
                  " (unmasked loop)")
  ap.add_argument("--opcodes", type=int, default=0,
                  help="also list this many of the largest loop body's most"
                  " frequent opcodes")
  a = ap.parse_args(argv)
  ts.TUNING.update(json.loads(a.source_grad_tuning or "{}"))
  ts.SOURCES_TUNING.update(json.loads(a.sources_tuning or "{}"))
  ts.QGRAD_TUNING.update(json.loads(a.qgrad_tuning or "{}"))
  ts.SITES_TUNING.update(json.loads(a.sites_tuning or "{}"))
  ts.NORM_TUNING.update(json.loads(a.norm_tuning or "{}"))
  meta = dict(tr.tile_meta(a.d, a.h), EPS=1e-6)
  bn = tr._tokens_per_program(tr.tile_width(a.d, a.h), 16, a.warps)
  common = dict(meta, NSRC=a.nsrc, PF=a.pf, BN=bn)
  runs = {
      "fwd": (tr._fwd_kernel, BF16["fwd"], dict(
          common, INIT=0, LAST=True, HAS_R=False, WRITE_R=True, G=1,
          PIN=True)),
      "fwd_r": (tr._fwd_kernel, BF16["fwd"], dict(
          common, INIT=0, LAST=True, HAS_R=True, WRITE_R=False, G=1,
          PIN=True)),
      "cpass": (tr._cpass_kernel, BF16["cpass"], dict(
          common, FIRST=True, PIN=True, HAS_R=False)),
      "cpass_r": (tr._cpass_kernel, BF16["cpass"], dict(
          common, FIRST=True, PIN=True, HAS_R=True)),
      "bwd": (tr._bwd_kernel, BF16["bwd"], dict(
          common, PF=tr.TUNING["bwd_prefetch"], HAS_R=False)),
      "bwd_r": (tr._bwd_kernel, BF16["bwd"], dict(
          common, PF=tr.TUNING["bwd_prefetch"], HAS_R=True)),
      "source_grad": (ts.source_grad_kernel, BF16["source_grad"], dict(
          tr.tile_meta(a.d, a.h), BN=ts.tokens_per_program(a.d, a.h),
          STAGES=ts.TUNING["stages"], INIT=False, PARTIAL=False)),
      "source_grad_init": (ts.source_grad_kernel,
                           BF16["source_grad"] | {"acc_ptr"}, dict(
          tr.tile_meta(a.d, a.h), BN=ts.tokens_per_program(a.d, a.h),
          STAGES=ts.TUNING["stages"], INIT=True, PARTIAL=False)),
  }
  c = a.d // a.h
  qgrad = ts.qgrad_launch(c, a.qgrad_sites)
  qgrad_warps = qgrad.pop("warps")
  runs["query_gain_grad"] = (ts.query_gain_grad_kernel, {"s_ptr"}, dict(
      D=a.d, C=c, STAGES=ts.QGRAD_TUNING["stages"], LOWP=True,
      UNIT=a.qgrad_unit, DA=4, EVEN_K=True, WHOLE_M=a.qgrad_unit == 2,
      **qgrad))
  for name, ndy in (("norm_grad", 1), ("norm_grad_3dy", 3)):
    runs[name] = (ts.norm_grad_kernel, BF16["norm_grad"], dict(
        meta, BN=ts.norm_grad_programs(1 << 20, a.d, a.h)[0],
        STAGES=ts.NORM_TUNING["stages"], NDY=ndy))
  tu = ts.SITES_TUNING
  runs["sites"] = (ts.sites_kernel, {"x_ptr", "out_ptr"}, dict(
      tr.tile_meta(a.d, a.h), G=16, SB=tu["source_block"],
      BT=tu["tokens_per_program"], STAGES=tu["stages"], LOWP=True,
      EVEN_S=a.even_sites, CAUSAL=False, SPLIT_P=tu["split_weights"]))
  tu = ts.SOURCES_TUNING
  for name, nx in (("sources", 1), ("sources_4buffers", ts.SOURCES_BUFFERS)):
    runs[name] = (ts.sources_kernel, {"s_ptr", "dx_ptr", "dx1_ptr", "dx2_ptr",
                                      "dx3_ptr", "acc_ptr", "t_ptr",
                                      "tlo_ptr"}, dict(
        tr.tile_meta(a.d, a.h), G=16, MB=tu["site_block"],
        BT=tu["tokens_per_program"], STAGES=tu["stages"], LOWP=True,
        EVEN_M=a.even_sites, INIT=True, NX=nx))
  print(f"triton {triton.__version__}, sm_90, D={a.d} H={a.h} "
        f"NSRC={a.nsrc} PF={a.pf} warps={a.warps} BN={bn}", flush=True)
  rows = []
  for name in a.kernels.split(","):
    fn, bf16, cons = runs[name]
    warps = {"source_grad": ts.TUNING["warps"],
             "source_grad_init": ts.TUNING["warps"],
             "sites": ts.SITES_TUNING["warps"],
             "sources": ts.SOURCES_TUNING["warps"],
             "sources_4buffers": ts.SOURCES_TUNING["warps"],
             "query_gain_grad": qgrad_warps,
             "norm_grad": ts.NORM_TUNING["warps"],
             "norm_grad_3dy": ts.NORM_TUNING["warps"]}.get(name, a.warps)
    cons = {k: v for k, v in cons.items() if k in fn.arg_names}
    if a.ones:
      cons.update({k: 1 for k in fn.arg_names if k in SCALARS})
    rows.append(report(name, *compile_kernel(fn, bf16, cons, warps), warps,
                       a.opcodes))
    print(json.dumps(rows[-1]), flush=True)
  return rows


if __name__ == "__main__":
  main()
