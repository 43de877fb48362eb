"""The bytes a training step spends copying: XLA's pure data-movement kernels.

    python3 benchmarks/hlo_copies.py --runs 1b/mhar [--deviceless] [--top 12]

For each ``preset/scheme`` (as in benchmarks/throughput.py) a fresh process
compiles the trainer's step (no run) with XLA dumping its optimized HLO, and
this lists the kernels that only move data: top-level ``copy`` instructions
and fusions whose every operation is a slice, transpose, copy, concatenate,
reshape or bitcast (e.g. a row sliced out of a buffer to be a custom call's
operand, or a layout change before a matrix product). Each is counted at
twice its output's bytes (read and written), per computation: the
gradient-accumulation loop's body runs once a microbatch. Bytes a
microbatch over the device's copy bandwidth bound the time they cost;
nothing here needs a GPU (``--deviceless``: compiled for an H200, see
``h200_aot``).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

MOVES = {"parameter", "slice", "dynamic-slice", "transpose", "copy",
         "concatenate", "reshape", "bitcast", "constant", "tuple",
         "get-tuple-element"}
BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2,
         "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8,
         "u64": 8}
_COMP = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INST = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string (arrays, or a tuple of them)."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    if dtype in BYTES:
      n = 1
      for x in filter(None, dims.split(",")):
        n *= int(x)
      total += n * BYTES[dtype]
  return total


def parse(hlo: str) -> dict:
  """``{computation: [(name, shape, opcode, rest of line)]}`` of HLO text."""
  comps, cur = {}, None
  for line in hlo.splitlines():
    m = _COMP.match(line)
    if m and "=" not in line.split("{")[0].split("(")[0]:
      cur = comps.setdefault(m.group(2), [])
      continue
    m = _INST.match(line)
    if m and cur is not None:
      cur.append(m.groups())
  return comps


def copies(hlo: str) -> list[dict]:
  """The data-movement kernels of ``hlo`` (optimized HLO text): one dict per
  kernel with its computation, name, shape, traffic (2 x output bytes) and
  JAX op name."""
  comps = parse(hlo)
  pure = {name for name, insts in comps.items()
          if insts and all(op in MOVES for _, _, op, _ in insts)}
  fused = set()
  for insts in comps.values():
    for _, _, op, rest in insts:
      m = re.search(r"calls=%?([\w.\-]+)", rest)
      if op == "fusion" and m:
        fused.add(m.group(1))
  out = []
  for comp, insts in comps.items():
    if comp in fused:
      continue
    for name, shape, op, rest in insts:
      m = re.search(r"calls=%?([\w.\-]+)", rest)
      if op == "copy" or (op == "fusion" and m and m.group(1) in pure):
        opname = re.search(r'op_name="([^"]*)"', rest)
        out.append(dict(computation=comp, name=name, shape=shape,
                        bytes=2 * shape_bytes(shape),
                        op=opname.group(1) if opname else ""))
  return out


def summary(found: list[dict], top: int, min_bytes: int = 2**20) -> str:
  """Per computation moving at least ``min_bytes``: the copies' total bytes,
  then the largest kinds (same shape and JAX op) with their counts."""
  lines = []
  by_comp = collections.defaultdict(list)
  for c in found:
    by_comp[c["computation"]].append(c)
  for comp, cs in sorted(by_comp.items(),
                         key=lambda kv: -sum(c["bytes"] for c in kv[1])):
    total = sum(c["bytes"] for c in cs)
    if total < min_bytes:
      continue
    lines.append(f"  {comp}: {len(cs)} copies, {total / 2**30:.2f} GiB moved")
    kinds = collections.Counter()
    count = collections.Counter()
    for c in cs:
      key = (re.sub(r"\{[^}]*\}", "", c["shape"]), c["op"])
      kinds[key] += c["bytes"]
      count[key] += 1
    for (shape, op), b in kinds.most_common(top):
      lines.append(f"    {b / 2**30:7.2f} GiB  {count[shape, op]:4d} x "
                   f"{shape}  {op}")
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--runs", default="tiny/mhar")
  ap.add_argument("--micro_tokens", type=int, default=32768)
  ap.add_argument("--top", type=int, default=8)
  ap.add_argument("--deviceless", action="store_true")
  ap.add_argument("--xla_remat", action="store_true")
  a = ap.parse_args()
  import peak_buffers
  for run in a.runs.split(","):
    with tempfile.TemporaryDirectory() as dump:
      rc = peak_buffers.compile_with_dump(run, dump, a.micro_tokens,
                                          a.xla_remat, a.deviceless)
      files = sorted(glob.glob(os.path.join(
          dump, "*jit_step*after_optimizations.txt")))
      if rc or not files:
        print(f"== {run}: compile failed (rc {rc})")
        continue
      with open(files[0]) as f:
        found = copies(f.read())
    print(f"== {run}: {sum(c['bytes'] for c in found) / 2**30:.2f} GiB "
          f"moved by {len(found)} data-movement kernels (each counted once)")
    print(summary(found, a.top), flush=True)


if __name__ == "__main__":
  main()
