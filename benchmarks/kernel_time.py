"""Where a jitted step's GPU time goes: kernel time by category from a JAX trace.

    with jax.profiler.trace(DIR): ...run N steps...
    table = breakdown(kernel_events(DIR), steps=N)

``kernel_events`` reads the ``*.xplane.pb`` that ``jax.profiler`` wrote under
``DIR`` and returns ``(kernel name, duration ns, start ns)`` for every kernel
that ran on the first GPU (events on its ``Stream ...`` lines; the ``XLA Ops``
/ ``XLA Modules`` lines repeat the same time and are skipped). ``breakdown``
sums them into the categories of :data:`CATEGORIES` (first match wins), lists
the largest kernels and the time some kernel ran (kernels on several streams
overlap: the sum exceeds it by their overlap), all in milliseconds per step.
"""

from __future__ import annotations

import collections
import glob
import os
import re

# (category, regex on the kernel name), tried in order.
CATEGORIES = (
    ("routing (Triton)", r"_fwd_kernel|_cpass_kernel|_bwd_kernel|source_grad_kernel"
                         r"|sites_kernel|sources_kernel|query_gain_grad_kernel"
                         r"|_no_write_kernel"),
    ("attention (cuDNN)", r"cudnn|fmha|flash|sdpa"),
    ("matmul", r"gemm|xmma|nvjet|cutlass|cublas|triton_dot|__dot|_dot_|sm90_"
               r"|sm80_|wgmma"),
    ("reduction fusion", r"reduce|input_|softmax|logsumexp"),
    ("copy / transpose", r"copy|memcpy|memset|transpose|concatenate|dynamic[_-]update"
                         r"|dynamic[_-]slice"),
    ("elementwise fusion", r"fusion|loop_|convert|multiply|add|select"),
)


def categorize(name: str) -> str:
  """The category of one kernel name (``"other"`` if no pattern matches)."""
  low = name.lower()
  for cat, pattern in CATEGORIES:
    if re.search(pattern, low):
      return cat
  return "other"


def kernel_events(trace_dir: str, device: str = "/device:GPU:0"
                  ) -> list[tuple[str, float, float]]:
  """``(name, duration_ns, start_ns)`` of every kernel on ``device`` in the
  trace under ``trace_dir`` (the newest ``*.xplane.pb``). Raises
  FileNotFoundError if there is no trace and ValueError if it has no such
  device plane."""
  from jax.profiler import ProfileData
  files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"),
                           recursive=True), key=os.path.getmtime)
  if not files:
    raise FileNotFoundError(f"no *.xplane.pb under {trace_dir!r}")
  data = ProfileData.from_file(files[-1])
  planes = {p.name: p for p in data.planes}
  if device not in planes:
    raise ValueError(f"trace has no plane {device!r}; planes: {sorted(planes)}")
  events = []
  for line in planes[device].lines:
    if not line.name.startswith("Stream"):
      continue
    events.extend((e.name, float(e.duration_ns), float(e.start_ns))
                  for e in line.events)
  return events


def kernel_family(name: str) -> str:
  """``name`` without XLA's numeric suffix (``loop_add_fusion_584`` ->
  ``loop_add_fusion``): one row for the instances of a fusion kind."""
  return re.sub(r"(_\d+)+$", "", name)


def breakdown(events, steps: int, top: int = 20) -> dict:
  """Per-step milliseconds by category and the ``top`` largest kernels.

  Returns ``{"total_ms", "busy_ms", "span_ms", "idle_after",
  "idle_before", "categories": {cat: ms}, "top": [(name, ms, calls)],
  "kernels": {name: [ms, calls]}}`` (``busy_ms``: the time at least one
  kernel ran, the union of the ``(start, duration)`` intervals; ``span_ms``:
  first kernel's start to last kernel's end, so ``span_ms - busy_ms`` is the
  GPU's idle time between the traced kernels; ``idle_after`` /
  ``idle_before``: the ``top`` kernel families (:func:`kernel_family`) by
  the idle time that follows / precedes their kernels, as ``(family, ms,
  gaps)``; ``kernels``: every kernel, so that two runs' steps can be
  compared kernel by kernel) with every figure divided by ``steps``.
  """
  per_cat = collections.Counter()
  per_name = collections.Counter()
  calls = collections.Counter()
  idle_after, idle_before = collections.Counter(), collections.Counter()
  gaps_after, gaps_before = collections.Counter(), collections.Counter()
  busy, end, last = 0.0, float("-inf"), None
  events = sorted(events, key=lambda e: e[2])
  for name, ns, start in events:
    per_cat[categorize(name)] += ns
    per_name[name] += ns
    calls[name] += 1
    if last is not None and start > end:
      a, b = kernel_family(last), kernel_family(name)
      idle_after[a] += start - end
      gaps_after[a] += 1
      idle_before[b] += start - end
      gaps_before[b] += 1
    busy += max(0.0, start + ns - max(start, end))
    end = max(end, start + ns)
    last = name
  scale = 1e-6 / steps
  span = end - events[0][2] if events else 0.0

  def idle(ms, gaps):
    return [(n[:90], v * scale, gaps[n] / steps)
            for n, v in ms.most_common(top)]

  return {
      "total_ms": sum(per_cat.values()) * scale,
      "busy_ms": busy * scale,
      "span_ms": span * scale,
      "idle_after": idle(idle_after, gaps_after),
      "idle_before": idle(idle_before, gaps_before),
      "categories": {c: v * scale for c, v in per_cat.most_common()},
      "top": [(n[:90], v * scale, calls[n] / steps)
              for n, v in per_name.most_common(top)],
      "kernels": {n[:200]: [v * scale, calls[n] / steps]
                  for n, v in per_name.most_common()},
  }


def format_breakdown(label: str, b: dict, step_ms: float | None = None) -> str:
  """A markdown table of one :func:`breakdown` (``step_ms``: the timed step)."""
  head = (f"\n{label}: kernels {b['total_ms']:.1f} ms a step, some kernel"
          f" running {b['busy_ms']:.1f} ms (overlap"
          f" {b['total_ms'] - b['busy_ms']:.1f})")
  if step_ms:
    head += f"; timed step {step_ms:.1f} ms: {b['busy_ms'] / step_ms:.0%} busy"
  if "span_ms" in b:
    head += (f"\nidle between kernels {b['span_ms'] - b['busy_ms']:.1f} ms a"
             f" step (span {b['span_ms']:.1f} ms); idle after / before kernels"
             " of a family (ms, gaps a step): after "
             + ", ".join(f"`{n}` {ms:.2f} ({g:g})"
                         for n, ms, g in b["idle_after"][:6])
             + "; before "
             + ", ".join(f"`{n}` {ms:.2f} ({g:g})"
                         for n, ms, g in b["idle_before"][:6]))
  rows = ["| category | ms / step | share |", "|---|---|---|"]
  for cat, ms in b["categories"].items():
    rows.append(f"| {cat} | {ms:.1f} | {ms / b['total_ms']:.1%} |")
  rows += ["", "| kernel | ms / step | calls / step |", "|---|---|---|"]
  rows += [f"| `{n}` | {ms:.2f} | {c:g} |" for n, ms, c in b["top"]]
  return head + "\n" + "\n".join(rows)
