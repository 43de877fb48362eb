"""The buffers live at a compiled step's peak, grouped by (size, JAX operation)
with their count: which arrays of the same kind are live there.

    python3 peak_by_op.py DUMP_DIR/module_0001.jit_step.sm_9.0a_gpu_after_optimizations

(the prefix of XLA's ``*-live-range.txt`` and ``.txt`` dumps, as written by
``benchmarks/peak_buffers.compile_with_dump``; the live buffers are
``peak_buffers.peak_report``'s). Session 25 (RESULTS.md).
"""

import collections
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from peak_buffers import peak_report  # noqa: E402

prefix = sys.argv[1]
live = peak_report(open(prefix + "-live-range.txt").read())["live"]
hlo = open(prefix + ".txt").read()
total, count = collections.Counter(), collections.Counter()
for name, size in live:
  m = re.search("%" + re.escape(name.split("{")[0]) + r' = .*?op_name="([^"]*)"',
                hlo)
  key = (size, re.sub(r"\d+", "#", m.group(1))[:90] if m else "?")
  total[key] += size
  count[key] += 1
for (size, op), n in sorted(total.items(), key=lambda x: -x[1])[:25]:
  print(f"{n / 2**30:7.3f} GiB  {count[size, op]:3d} x {size / 2**20:8.1f} MiB  {op}")
