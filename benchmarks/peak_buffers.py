"""What is live at a training step's peak of device memory (XLA's own report).

    python3 benchmarks/peak_buffers.py --runs 1b/prenorm,1b/mhar [--top 12]
        [--deviceless] [--xla_remat]

For each ``preset/scheme`` (as in benchmarks/throughput.py) a fresh process
compiles the trainer's step (no run) with XLA dumping its buffer assignment,
and this prints, from XLA's live-range dump (``*-live-range.txt``), the
bytes live at the step's peak by the JAX operation that made them and the
largest buffers live there, and (from the buffer assignment) how far XLA's
allocation of the temporaries exceeds the most bytes live in it at once: the
holes in its layout then, and what holds each hole at other times. Comparing a
scheme with the baseline shows what the scheme's extra memory is (e.g. the
routed sources saved for the backward, or its whole-stack cotangent buffer).
Runs on the CPU too (``tiny``), for a check of the plumbing; with
``--deviceless``, compiles for an H200 on a machine without one (same
program as on the device but for autotuning's choices; ``h200_aot``).
XLA's rematerialization is off as in the throughput benchmark unless
``--xla_remat``.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile

import throughput   # this directory: on the path when run or imported

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def peak_report(text: str) -> dict:
  """From XLA's ``*-live-range.txt`` dump of a module: the schedule position
  of the peak, the buffers live there (``(name, bytes)``, largest first) and
  the peak's bytes by the JAX operation that made them (``(op, bytes)``, the
  first level of XLA's "stack trace breakdown", largest first)."""
  m = re.search(r"Live ranges at (\d+) \(peak\):\n(.*?)\n  \S", text, re.S)
  live = []
  if m:
    for line in m.group(2).splitlines():
      b = re.match(r"\s*(\S+): (\d+) bytes", line)
      if b:
        live.append((b.group(1), int(b.group(2))))
  total = re.search(r"Stack trace breakdown for peak usage: ([\d ]+) bytes",
                    text)
  by_op = []
  if total:
    tail = text[total.end():]
    for line in tail.splitlines()[2:]:      # after the root line
      b = re.match(r"      [├└]── (.*) \([\d.]+%, total: ([\d ]+) bytes", line)
      if b:
        by_op.append((b.group(1), int(b.group(2).replace(" ", ""))))
      elif line.strip() and not line.startswith("      "):
        break
  return dict(
      position=int(m.group(1)) if m else None,
      peak=int(total.group(1).replace(" ", "")) if total else None,
      live=sorted(live, key=lambda x: -x[1]),
      by_op=sorted(by_op, key=lambda x: -x[1]))


def _name(n: str) -> str:
  """A buffer's name as both dumps can spell it (``fusion.3{}`` = ``fusion.3``)."""
  return n[:-2] if n.endswith("{}") else n


def heap_report(assignment: str, live_range: str, min_hole: int = 1 << 26
                ) -> dict:
  """Where XLA's temporary allocation exceeds the bytes live in it.

  From the ``*-buffer-assignment.txt`` dump (each temporary's offset and size
  in the one preallocated-temp allocation) and ``*-live-range.txt`` (each
  buffer's ``start-end`` in the schedule, end exclusive here): the
  allocation's size (``extent``, the highest offset + size), the most bytes
  live in it at once (``live``) and when (``at``), and the holes of at least
  ``min_hole`` bytes in the layout at that time, each ``(offset, size,
  [(name, size, start, end), ...])`` with the buffers of at least
  ``min_hole`` bytes that hold that range at some other time (what the hole
  is kept free for); ``at_peak``: the temporaries live then, ``(name, size,
  start, end)``, largest first."""
  i = assignment.find("preallocated-temp:")
  if i < 0:
    return dict(extent=0, live=0, at=None, at_peak=[], holes=[])
  j = assignment.find("\nallocation", i)
  seg = assignment[i:j if j >= 0 else len(assignment)]
  spans = {_name(m.group(1)): (int(m.group(2)), int(m.group(3)))
           for m in re.finditer(r"^    (\S+):(\d+)-(\d+)$", live_range, re.M)}
  bufs = []
  for m in re.finditer(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\)",
                       seg):
    name = _name(m.group(1))
    if name in spans:
      s, e = spans[name]
      bufs.append((name, int(m.group(2)), int(m.group(3)), s, max(e, s + 1)))
  events = sorted([(s, size) for _, size, _, s, _ in bufs]
                  + [(e, -size) for _, size, _, _, e in bufs])
  live = best = 0
  at = None
  for k, (t, d) in enumerate(events):
    live += d
    if live > best and (k + 1 == len(events) or events[k + 1][0] != t):
      best, at = live, t
  extent = max((off + size for _, size, off, _, _ in bufs), default=0)
  holes, pos = [], 0
  for name, size, off, s, e in sorted((b for b in bufs if b[3] <= at < b[4]),
                                      key=lambda b: b[2]):
    if off - pos >= min_hole:
      holes.append((pos, off - pos))
    pos = max(pos, off + size)
  if extent - pos >= min_hole:
    holes.append((pos, extent - pos))
  at_peak = sorted(((n, size, s, e) for n, size, _, s, e in bufs
                    if s <= at < e), key=lambda b: -b[1])
  return dict(extent=extent, live=best, at=at, at_peak=at_peak, holes=[
      (p, g, sorted(((n, size, s, e) for n, size, off, s, e in bufs
                     if size >= min_hole and off < p + g and off + size > p),
                    key=lambda b: b[2]))
      for p, g in holes])


def op_names(hlo: str) -> dict:
  """Instruction name -> the JAX operation that made it (``op_name``), from
  an optimized module's text (:func:`hlo_copies.parse`)."""
  import hlo_copies   # this directory, as throughput
  out = {}
  for insts in hlo_copies.parse(hlo).values():
    for name, _, _, rest in insts:
      m = re.search(r'op_name="([^"]*)"', rest)
      if m:
        out[name] = m.group(1)
  return out


def rematerialized(hlo: str) -> int:
  """Instructions XLA's rematerialization pass added (named ``*.remat*``) in
  an optimized module's text."""
  return len(re.findall(r"^\s*(?:ROOT )?%[^\s=]*\.remat[^\s=]* = ", hlo, re.M))


def op_key(op: str) -> str:
  """A JAX operation name without its transformation wrappers, so the same
  operation compares equal across schemes: ``jit(step)/jvp(jvp(vmap()))/div``
  -> ``div``; ``.../transpose(jvp(btd,dhk->bthk))/dot_general`` ->
  ``bwd btd,dhk->bthk/dot_general``."""
  parts = op.split("/")[1:] or [op]
  bwd = any("transpose(" in x for x in parts)
  kept = [re.sub(r"(jvp|transpose|vmap|jit|remat|checkpoint)\(|\)", "", x)
          for x in parts]
  return ("bwd " if bwd else "") + "/".join(x for x in kept if x)


def compile_with_dump(run: str, dump: str, micro_tokens: int,
                      xla_remat: bool, deviceless: bool) -> int:
  """Compiles ``run``'s train step in a child process dumping to ``dump``
  (for an H200 without one if ``deviceless``: :mod:`h200_aot`)."""
  preset, _, scheme = run.partition("/")
  env = throughput.child_env(xla_remat, run)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
                      " --xla_dump_hlo_module_re=jit_step")
  code = ("import sys; sys.path.insert(0, %r); devices = None\n"
          % os.path.join(ROOT, "benchmarks"))
  if deviceless:
    code += "import h200_aot; devices = h200_aot.setup()\n"
  code += ("import throughput; throughput.child(%r, %r, 0, 0, %d, 'auto', '',"
           " True, devices=devices)" % (preset, scheme, micro_tokens))
  return subprocess.run([sys.executable, "-c", code], env=env).returncode


def _by_key(by_op):
  out = {}
  for op, n in by_op:
    out[op_key(op)] = out.get(op_key(op), 0) + n
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--runs", default="tiny/prenorm,tiny/mhar")
  ap.add_argument("--top", type=int, default=12)
  ap.add_argument("--micro_tokens", type=int, default=32768)
  ap.add_argument("--xla_remat", action="store_true",
                  help="let XLA rematerialize (as benchmarks/throughput.py)")
  ap.add_argument("--deviceless", action="store_true",
                  help="compile for an H200 on this machine, without a GPU"
                  " (benchmarks/h200_aot.py says what that needs)")
  a = ap.parse_args()
  first = None
  for run in a.runs.split(","):
    with tempfile.TemporaryDirectory(prefix="mhar_dump_") as dump:
      rc = compile_with_dump(run, dump, a.micro_tokens, a.xla_remat,
                             a.deviceless)
      files = sorted(glob.glob(os.path.join(dump, "*jit_step*live-range.txt")),
                     key=os.path.getsize)
      if rc or not files:
        print(f"== {run}: compile rc {rc}, {len(files)} live-range dumps")
        continue
      rep = peak_report(open(files[-1]).read())
      assignment = glob.glob(files[-1].replace("live-range.txt",
                                               "buffer-assignment.txt"))
      heap = (heap_report(open(assignment[0]).read(), open(files[-1]).read())
              if assignment else None)
      hlo = sorted(glob.glob(os.path.join(
          dump, "*jit_step*after_optimizations.txt")), key=os.path.getsize)
      hlo_text = open(hlo[-1]).read() if hlo else ""
      remat = rematerialized(hlo_text) if hlo else "?"
      gib = lambda x: f"{x / 2**30:8.3f} GiB" if x is not None else "-"  # noqa: E731
      print(f"== {run}: peak {gib(rep['peak'])} at schedule position "
            f"{rep['position']}; {remat} rematerialized instructions")
      print("  by operation:")
      for op, n in rep["by_op"][:a.top]:
        print(f"  {gib(n)}  {op[-100:]}")
      print("  largest buffers live at the peak:")
      for name, n in rep["live"][:a.top]:
        print(f"  {gib(n)}  {name}")
      if heap:
        print(f"  temporaries: allocation {gib(heap['extent'])}, at most"
              f" {gib(heap['live'])} live (position {heap['at']}); holes there:")
        for off, size, held in heap["holes"]:
          print(f"  {gib(size)} at offset {off / 2**30:.2f} GiB, held at other"
                " times by: " + ", ".join(f"{n} ({m / 2**30:.2f} GiB, {s0}-{e0})"
                                         for n, m, s0, e0 in held[:4]))
        ops = op_names(hlo_text)
        print("  largest temporaries live there (schedule span, operation):")
        for n, m, s0, e0 in heap["at_peak"][:a.top]:
          print(f"  {gib(m)}  {n} ({s0}-{e0}) "
                f"{op_key(ops.get(n.split('{')[0], '?'))}")
      if first is None:
        first = (run, _by_key(rep["by_op"]))
        continue
      mine = _by_key(rep["by_op"])
      diff = sorted(((mine.get(k, 0) - first[1].get(k, 0), k)
                     for k in set(mine) | set(first[1])), key=lambda x: -abs(x[0]))
      print(f"  by operation, minus {first[0]}'s:")
      for n, op in diff[:a.top]:
        print(f"  {n / 2**30:+8.3f} GiB  {op[-100:]}")


if __name__ == "__main__":
  main()
