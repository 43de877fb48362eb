"""Which of a training step's thunks XLA runs inside command buffers.

    python3 benchmarks/command_buffers.py --runs 100m/mhar,\
100m/mhar+kernels.route.ffi_launch=True [--deviceless]

For each ``preset/scheme`` (as in benchmarks/throughput.py) a fresh process
compiles the trainer's step with XLA dumping its thunk sequence after the
thunk passes (``*thunk_sequence_after_thunk_passes.txt``), and this prints
the thunks by kind inside and outside command buffers (CUDA graphs): each
thunk outside one, and each command buffer, is a launch the host issues
while the GPU runs the step (static counts; a loop body's once). A Triton
call (``kCustomCall``) outside them splits the graph around it.

On a machine without a GPU (``--deviceless``, :mod:`h200_aot`) XLA knows no
driver version and drops custom calls and cuDNN from command buffers (it
needs CUDA >= 12.3 to trace them), so only the device's compile says where
they go.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import tempfile

import peak_buffers  # this directory: on the path when run or imported

_THUNK = re.compile(r"^(\s*)\d+: (k\w+)")


def thunk_kinds(text: str) -> tuple[collections.Counter, collections.Counter]:
  """From XLA's thunk-sequence dump: ``(inside, outside)``, thunk counts by
  kind (``kCustomKernel``, ``kCustomCall``, ...) inside a ``kCommandBuffer``
  and not; a command buffer itself counts outside (the host launches it).
  Nesting is read from the indentation."""
  inside, outside = collections.Counter(), collections.Counter()
  stack: list[tuple[int, str]] = []      # (indent, kind) of the enclosing
  for line in text.splitlines():
    m = _THUNK.match(line)
    if not m:
      continue
    indent, kind = len(m.group(1)), m.group(2)
    while stack and stack[-1][0] >= indent:
      stack.pop()
    in_buffer = any(k == "kCommandBuffer" for _, k in stack)
    (inside if in_buffer else outside)[kind] += 1
    stack.append((indent, kind))
  return inside, outside


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--runs", default="tiny/mhar")
  ap.add_argument("--micro_tokens", type=int, default=32768)
  ap.add_argument("--deviceless", action="store_true",
                  help="compile for an H200 on this machine, without a GPU")
  a = ap.parse_args()
  for run in a.runs.split(","):
    with tempfile.TemporaryDirectory(prefix="mhar_dump_") as dump:
      rc = peak_buffers.compile_with_dump(run, dump, a.micro_tokens, False,
                                          a.deviceless)
      files = sorted(glob.glob(os.path.join(
          dump, "*jit_step*thunk_sequence_after_thunk_passes.txt")),
          key=os.path.getsize)
      if rc or not files:
        print(f"== {run}: compile rc {rc}, {len(files)} thunk dumps")
        continue
      inside, outside = thunk_kinds(open(files[-1]).read())
      fmt = lambda c: ", ".join(f"{k} {n}" for k, n in c.most_common())  # noqa: E731
      print(f"== {run}: {sum(outside.values())} host launches"
            f" ({outside['kCommandBuffer']} command buffers), "
            f"{sum(inside.values())} thunks inside command buffers")
      print(f"  outside: {fmt(outside)}")
      print(f"  inside:  {fmt(inside)}")


if __name__ == "__main__":
  main()
