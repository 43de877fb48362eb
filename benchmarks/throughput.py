"""Training throughput of each residual scheme against the baseline, in one run.

    python benchmarks/throughput.py --presets 100m,350m,1b \
        --schemes prenorm,hyper,attnres,mhar,mhar_b8 [--routing_impl auto]

For every (preset, scheme) a fresh process (so peak memory is its own) builds
the preset's model in bf16 with fp32 parameters, jits the full train step
(forward + backward + AdamW, the trainer's own step function) on random
tokens of the preset's sequence length and global batch, runs ``--warmup``
steps, then times ``--steps`` steps waited for one by one (their median,
"waited": each pays the host's work a step in full) and ``--steps`` more back
to back, three times (dispatched without waiting, as the trainer runs them,
which hides that work behind the step before: the step time is the median
of the three spans' means).
Printed: tokens/s (of the back-to-back steps), MFU (FLOPs per token
``6N + 6 L H_q d_h T``, dense bf16
peak 989 TFLOP/s for H100/H200), peak device memory (``memory_stats``),
the memory XLA planned for the step (its buffer assignment) and the ratios
to ``prenorm`` of the same preset measured in the same run. XLA's
rematerialization pass is off unless ``--xla_remat``: with it, XLA recomputes
values until the program fits a limit derived from the memory pool, so every
scheme's peak sits near that limit and its time includes the recomputation.
``--compile_only`` compiles every run into the persistent cache and times none
(the GPU tests can run beside it; a later call times from the cache).
``--profile N`` then traces N more steps with ``jax.profiler`` and prints
where each run's GPU time goes (kernel time by category and the largest
kernels, per step; :mod:`kernel_time`); ``--profile_runs`` limits that to
the runs it lists.

Schemes: ``prenorm``, ``hyper``, ``attnres``, ``mhar`` (H=8, the default
source-major backward; with Triton its sites in groups of 16 on tensor cores,
``mhar+routing_site_group=0`` each alone), ``mhar_b8`` (H=8, 8 blocks),
``mhar_site`` (H=8 with ``routing_backward="site"``). The paper presets
recompute the lowest 3/4 of the sites' outputs (``recompute_site_outputs=0.75``;
``mhar+recompute_site_outputs=0`` keeps them all, as ``mhar_site`` does, and a
run with ``recompute_sources`` needs it too). Append ``:reference`` or ``:triton`` to force
the routing implementation (e.g. ``mhar:reference``) and ``+KEY=VALUE`` to
override a model config key (e.g. ``prenorm+remat=True``; another section's
with its name, ``mhar+train.loss_chunk_tokens=8192``; a Triton kernel's tuning
with ``kernels.NAME``, NAME one of ``route``, ``source_grad``, ``sites``,
``sources``, ``query_gain``, ``norm``: ``mhar+kernels.sites.warps=2``; an XLA flag
with ``xla.``, added to that run's ``XLA_FLAGS``, ``;`` for ``,`` in its
value: ``mhar+xla.xla_gpu_enable_command_buffer=FUSION;CUBLAS``). Presets are
config files in ``configs/`` (``100m``, ``350m``, ``1b``, ``bench100m``, ...).

Two phases: first every (preset, scheme) is compiled ahead of time, up to
``--compile_jobs`` processes at once (XLA's compile is host work), into JAX's
persistent compilation cache (``--cache_dir``); then each is timed alone, in
turn, loading its executable from that cache. The compile time reported is
the first phase's. ``--compile_jobs 0`` skips the first phase: each timing
process compiles its run, or loads it from the cache that a ``--compile_only``
call on the same machine filled (a 1b run's load takes ~55 s on an H100, paid
once instead of twice), and the time reported is that compile or load.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SCHEMES = {
    "prenorm": dict(residual="prenorm"),
    "hyper": dict(residual="hyper"),
    "attnres": dict(residual="attnres"),
    "mhar": dict(residual="mhar", routing_heads=8),
    "mhar_b8": dict(residual="mhar", routing_heads=8, num_blocks=8),
    "mhar_site": dict(residual="mhar", routing_heads=8,
                      routing_backward="site", recompute_site_outputs=0),
}


BACK_TO_BACK_SPANS = 3


def kernel_tunings() -> dict:
  """The Triton kernels' tuning dicts a run may override, by name
  (``+kernels.NAME.KEY=VALUE``)."""
  from mhar_jax.kernels import triton_route, triton_stack
  return {"route": triton_route.TUNING, "source_grad": triton_stack.TUNING,
          "sites": triton_stack.SITES_TUNING,
          "sources": triton_stack.SOURCES_TUNING,
          "query_gain": triton_stack.QGRAD_TUNING,
          "norm": triton_stack.NORM_TUNING}


def micro_tokens(spec: str) -> dict:
  """``--micro_tokens``: the largest microbatch in tokens (gradient
  accumulation above it), one number for every preset or a default followed
  by per-preset values: ``"32768,1b=16384"`` -> ``{"": 32768, "1b": 16384}``
  (preset ``1b`` in two 16k microbatches, every other in 32k ones)."""
  table = {}
  for i, item in enumerate(spec.split(",")):
    preset, _, value = item.rpartition("=")
    if (i == 0) == bool(preset) or preset in table or not value.isdigit() \
        or int(value) <= 0:
      raise argparse.ArgumentTypeError(
          f"{spec!r}: give a positive token count, then optionally"
          " PRESET=COUNT for each preset that differs, e.g. 32768,1b=16384")
    table[preset] = int(value)
  return table


def micro_tokens_of(table: dict, preset: str) -> int:
  """``preset``'s largest microbatch under ``--micro_tokens``'s ``table``."""
  return table.get(preset, table[""])


def load_preset(name):
  from mhar_jax.config import load_config_file
  return load_config_file(os.path.join(ROOT, "configs", f"{name}.py"))


def child(preset: str, scheme: str, steps: int, warmup: int,
          micro_tokens: int, routing_impl: str, cache_dir: str,
          compile_only: bool, profile: int = 0, devices=None) -> dict:
  t_start = time.time()

  def phase(msg):
    print(f"[{time.time() - t_start:6.1f}s] {preset}/{scheme}: {msg}",
          file=sys.stderr, flush=True)

  import jax
  import jax.numpy as jnp
  import numpy as np
  if cache_dir:
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  from mhar_jax import parallel, training
  from mhar_jax.config import validate
  devices = devices or jax.devices()[:1]
  phase(f"jax imported, {devices[0].device_kind}")

  scheme_impl, *overrides = scheme.split("+")
  name, _, impl = scheme_impl.partition(":")
  cfg = load_preset(preset)
  cfg.model.update(**SCHEMES[name])
  for kv in overrides:
    key, _, value = kv.partition("=")
    try:
      value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      pass
    section, _, key = key.rpartition(".")
    if section == "xla":
      continue                    # the parent set it (run_child, child_env)
    if section.startswith("kernels."):
      tunings = kernel_tunings()
      name = section.removeprefix("kernels.")
      if name not in tunings:
        raise KeyError(f"{kv}: no kernel tuning {name!r} ({sorted(tunings)})")
      tuning = tunings[name]
      if key not in tuning:
        raise KeyError(f"{kv}: {section} has no key {key!r} ({sorted(tuning)})")
      tuning[key] = value
    else:
      cfg[section or "model"][key] = value
  cfg.model.routing_impl = impl or routing_impl
  t = cfg.train
  tokens = t.global_batch * t.seq_len
  accum = 1
  while tokens // accum > micro_tokens and t.global_batch % (accum * 2) == 0:
    accum *= 2
  t.grad_accum = accum
  model_cfg = validate(cfg, num_devices=1)
  mesh = parallel.make_mesh(1, 1, devices)
  tx = training.make_optimizer(t)
  gdef = training.graphdef(model_cfg)
  state_sh = training.state_shardings_for(model_cfg, tx, mesh)
  batch_sh = parallel.batch_sharding(mesh)
  step = training.make_train_step(gdef, tx, t, state_sh, batch_sh)
  abstract = training.abstract_state(model_cfg, tx, state_sh)
  batch_spec = {k: jax.ShapeDtypeStruct((t.global_batch, t.seq_len), jnp.int32,
                                        sharding=batch_sh)
                for k in ("inputs", "targets")}
  t0 = time.time()
  step = step.lower(abstract, batch_spec).compile()
  compile_s = time.time() - t0
  xla_bytes = compiled_bytes(step)
  phase(f"train step compiled in {compile_s:.1f}s, XLA's plan "
        + (f"{xla_bytes / 2**30:.2f} GiB" if xla_bytes else "unknown"))
  t0 = time.time()
  init = training.compiled_init(model_cfg, tx, 0, state_sh)
  init_compile_s = time.time() - t0
  phase(f"initialiser compiled in {init_compile_s:.1f}s")
  if compile_only:
    return {"preset": preset, "scheme": scheme, "compile_s": compile_s,
            "init_compile_s": init_compile_s, "xla_bytes": xla_bytes}
  t0 = time.time()
  state = init()
  jax.block_until_ready(state)
  phase(f"state initialised in {time.time() - t0:.1f}s")
  rng = np.random.default_rng(0)
  batches = [{k: jax.device_put(rng.integers(0, model_cfg.vocab_size,
                                             (t.global_batch, t.seq_len),
                                             dtype=np.int32), batch_sh)
              for k in ("inputs", "targets")} for _ in range(2)]
  state, m = step(state, batches[0])
  jax.block_until_ready(m)
  phase("first step done")
  for i in range(warmup):
    state, m = step(state, batches[i % 2])
  jax.block_until_ready(m)
  times = []
  for i in range(steps):
    t0 = time.perf_counter()
    state, m = step(state, batches[i % 2])
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
  med = float(np.median(times))
  # Back to back, as the trainer runs them (it waits for the device only
  # when it logs): the host prepares each step while the device runs the one
  # before, so the host's work a step (argument handling, updating XLA's
  # command buffers) costs time only where it outlasts the device's step.
  # Waited for one by one (``times``), each step also pays it in full.
  spans = []
  for _ in range(BACK_TO_BACK_SPANS):
    t0 = time.perf_counter()
    for i in range(steps):
      state, m = step(state, batches[i % 2])
    jax.block_until_ready(m)
    spans.append((time.perf_counter() - t0) / steps)
  back_to_back = float(np.median(spans))
  prof = None
  if profile:
    import kernel_time
    trace_dir = tempfile.mkdtemp(prefix="mhar_trace_")
    try:   # a failed trace must not lose the timing above
      with jax.profiler.trace(trace_dir):
        for i in range(profile):
          state, m = step(state, batches[i % 2])
        jax.block_until_ready(m)
      prof = kernel_time.breakdown(kernel_time.kernel_events(trace_dir),
                                   profile)
      phase(f"profiled {profile} steps")
    except Exception as e:  # noqa: BLE001
      phase(f"profile failed: {type(e).__name__}: {e}")
  n_params = sum(int(x.size) for x in jax.tree.leaves(state["params"]))
  fpt = training.flops_per_token(model_cfg, t.seq_len)
  peak = training.peak_flops(devices[0])
  stats = devices[0].memory_stats() or {}
  from mhar_jax.kernels import resolve_impl
  return {"preset": preset, "scheme": scheme,
          "routing": (resolve_impl(cfg.model.routing_impl)
                      if name != "prenorm" and name != "hyper" else "-"),
          "params": n_params, "grad_accum": accum, "step_s": back_to_back,
          "step_s_spans": spans, "waited_step_s": med,
          "waited_step_s_spread": float(np.percentile(times, 90)
                                        - np.percentile(times, 10)),
          "tokens_per_s": tokens / back_to_back,
          "mfu": tokens / back_to_back * fpt / peak if peak else None,
          "peak_bytes": stats.get("peak_bytes_in_use"), "xla_bytes": xla_bytes,
          "load_s": compile_s, "loss": float(m["loss"]),
          "device": devices[0].device_kind, "profile": prof}


def compiled_bytes(compiled) -> int | None:
  """Device memory XLA planned for a compiled step: its arguments, outputs
  (less those donated into) and temporaries, from its buffer assignment
  (None where the backend does not say)."""
  try:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes
            - m.alias_size_in_bytes + m.temp_size_in_bytes)
  except Exception:  # noqa: BLE001  (a missing report must not lose a timing)
    return None


# XLA's rematerialization pass recomputes values to fit the program under a
# memory limit it derives from the client's memory pool; off, each scheme runs
# the program it asks for (and its peak is its own need, not the limit).
NO_REMAT = "--xla_disable_hlo_passes=rematerialization"


def child_env(xla_remat: bool, run: str = "") -> dict:
  """The environment of a child process for ``run``: ``XLA_FLAGS`` with
  XLA's rematerialization off (unless ``xla_remat``) and the run's
  ``+xla.FLAG=VALUE`` overrides."""
  env = dict(os.environ)
  flags = [] if xla_remat else [NO_REMAT]
  for kv in run.split("+")[1:]:
    key, _, value = kv.partition("=")
    if key.startswith("xla."):
      flags.append(f"--{key.removeprefix('xla.')}={value.replace(';', ',')}")
  if flags:
    env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", "")] + flags).strip()
  return env


def profiled(run: str, a) -> bool:
  """Whether ``run`` is traced (``--profile_runs``: those listed; else all)."""
  return not a.profile_runs or run in a.profile_runs.split(",")


def run_child(run: str, a, compile_only: bool, timeout: int):
  """Runs one child process; returns (result dict or None, message)."""
  cmd = [sys.executable, __file__, "--child", run,
         "--steps", str(a.steps), "--warmup", str(a.warmup),
         "--micro_tokens", str(micro_tokens_of(a.micro_tokens,
                                               run.split("/")[0])),
         "--routing_impl", a.routing_impl, "--cache_dir", a.cache_dir,
         "--profile", str(0 if compile_only or not profiled(run, a)
                          else a.profile)]
  env = child_env(a.xla_remat, run)
  if compile_only:
    cmd.append("--compile_only")
    # Several compiling processes share the GPU (XLA's autotuner allocates
    # there): none preallocates its pool. The pool's size stays the timing
    # process's: XLA plans the program (its rematerialization limit) for it,
    # and the persistent cache's key leaves it out, so the timed executable
    # is the one compiled here.
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  t0 = time.time()
  with tempfile.TemporaryFile("w+") as err:
    try:
      p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                         timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
      err.seek(0)
      phases = [l for l in err.read().splitlines() if l.startswith("[")]
      return None, (f"{run} TIMED OUT after {timeout}s; phases:\n  "
                    + "\n  ".join(phases))
    err.seek(0)
    stderr = err.read()
  lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
  if p.returncode or not lines:
    return None, f"{run} FAILED ({time.time() - t0:.0f}s):\n" + stderr[-3000:]
  return json.loads(lines[-1][7:]), f"wall {time.time() - t0:.0f}s"


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--presets", default="100m")
  ap.add_argument("--schemes", default="prenorm,hyper,attnres,mhar,mhar_b8")
  ap.add_argument("--runs", default="",
                  help="explicit PRESET/SCHEME list (instead of presets x"
                  " schemes), timed in this order")
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--micro_tokens", type=micro_tokens, default="16384",
                  help="largest microbatch in tokens (grad accumulation"
                  " above), for every preset or with per-preset values:"
                  " 32768,1b=16384")
  ap.add_argument("--routing_impl", default="auto")
  ap.add_argument("--json", default="", help="also write results here")
  ap.add_argument("--compile_jobs", type=int, default=3,
                  help="processes compiling at once in the first phase; 0:"
                  " no such phase, each timing process compiles its run or"
                  " loads it from --cache_dir itself (after a --compile_only"
                  " call on the same machine: one cache load a run, not two)")
  ap.add_argument("--cache_dir", default="/tmp/mhar_jax_bench_cache",
                  help="JAX persistent compilation cache shared by the phases")
  ap.add_argument("--compile_timeout", type=int, default=900,
                  help="seconds allowed per compile process")
  ap.add_argument("--compile_wait", type=int, default=900,
                  help="start timing after this many seconds even if some"
                  " runs are still compiling (those are timed last)")
  ap.add_argument("--timeout", type=int, default=180,
                  help="seconds allowed per timing process")
  ap.add_argument("--budget", type=int, default=0,
                  help="stop starting timing runs after this many seconds")
  ap.add_argument("--profile", type=int, default=0,
                  help="after timing, trace this many steps and print the"
                  " GPU kernel time by category")
  ap.add_argument("--profile_runs", default="",
                  help="trace only these runs (comma-separated, as in"
                  " --runs); default: every run")
  ap.add_argument("--xla_remat", action="store_true",
                  help="let XLA rematerialize to fit its memory limit (off by"
                  " default: each scheme's own program, its own peak)")
  ap.add_argument("--child", default="", help=argparse.SUPPRESS)
  ap.add_argument("--compile_only", action="store_true",
                  help="compile every run into --cache_dir and time none"
                  " (e.g. beside the GPU tests; a later call on the same"
                  " machine then times them from the cache)")
  a = ap.parse_args()
  if a.compile_jobs < 0 or (a.compile_only and a.compile_jobs == 0):
    ap.error(f"--compile_jobs {a.compile_jobs}: give 1 or more (--compile_only"
             " needs a compiling process), or 0 to time without a compile"
             " phase")
  if a.child:
    preset, scheme = a.child.split("/")
    print("RESULT " + json.dumps(child(preset, scheme, a.steps, a.warmup,
                                       micro_tokens_of(a.micro_tokens, preset),
                                       a.routing_impl,
                                       a.cache_dir, a.compile_only,
                                       a.profile)),
          flush=True)
    return
  start = time.time()
  print(f"XLA rematerialization {'on' if a.xla_remat else 'off'};"
        f" XLA_PYTHON_CLIENT_MEM_FRACTION"
        f" {os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION', 'unset')}",
        flush=True)
  runs = (a.runs.split(",") if a.runs else
          [f"{p}/{s}" for p in a.presets.split(",") for s in a.schemes.split(",")])
  compile_s, lock = {}, threading.Lock()
  pool = (concurrent.futures.ThreadPoolExecutor(a.compile_jobs)
          if a.compile_jobs else None)
  futures = {r: pool.submit(run_child, r, a, True, a.compile_timeout)
             for r in runs} if pool else {}

  def compiled(run):
    if not futures:                   # the timing process compiles it
      return True
    r, msg = futures[run].result()
    with lock:
      if run not in compile_s:
        compile_s[run] = r and r["compile_s"]
        msg = (f"compiled in {r['compile_s']:.0f}s, initialiser in"
               f" {r['init_compile_s']:.0f}s ({msg})" if r else msg)
        print(f"[{time.time() - start:5.0f}s] {run}: {msg}", flush=True)
    return compile_s[run]

  if a.compile_only:
    for run in runs:
      compiled(run)
    pool.shutdown()
    return
  concurrent.futures.wait(futures.values(), timeout=a.compile_wait)
  for run in runs:
    if run in futures and futures[run].done():
      compiled(run)
  # Timing in the given order; runs still compiling go last (their timings
  # may overlap other compiles, which the results mark).
  done = {r for r in runs if r not in futures or futures[r].done()}
  order = [r for r in runs if r in done] + [r for r in runs if r not in done]
  results = []
  for run in order:
    overlapped = not all(f.done() for f in futures.values())
    if not compiled(run):
      continue
    if a.budget and time.time() - start > a.budget:
      print(f"{run} SKIPPED (budget of {a.budget}s spent)", flush=True)
      continue
    r, msg = run_child(run, a, False, a.timeout)
    if r is None and overlapped and "RESOURCE_EXHAUSTED" in msg:
      # The compiling processes hold their share of the device memory: wait
      # for them (within the budget) and time this run again.
      print(f"{run}: out of device memory while other runs were compiling;"
            " waiting for them, then timing it again", flush=True)
      left = a.budget - (time.time() - start) if a.budget else None
      concurrent.futures.wait(futures.values(),
                              timeout=None if left is None else max(0, left))
      overlapped = not all(f.done() for f in futures.values())
      if not a.budget or time.time() - start < a.budget:
        r, msg = run_child(run, a, False, a.timeout)
    if r is None:
      print(msg, flush=True)
      continue
    # Without a compile phase: the timing process's own compile or load.
    r["compile_s"] = compile_s.get(run, r["load_s"])
    r["timed_during_compiles"] = overlapped
    results.append(r)
    print(f"[{time.time() - start:5.0f}s] {run}: {r['tokens_per_s']:,.0f}"
          f" tok/s, cache load {r['load_s']:.0f}s, {msg}"
          + (" (other runs were compiling)" if overlapped else ""), flush=True)
    if a.json:
      with open(a.json, "w") as f:
        json.dump(results, f, indent=1)
  if pool:
    pool.shutdown(wait=False, cancel_futures=True)
  print_table(results)


def print_table(results):
  base = {r["preset"]: r for r in results if r["scheme"] == "prenorm"}
  print("\n| preset | scheme | routing | accum | compile s | step ms |"
        " waited ms | tokens/s | MFU | peak GiB | XLA GiB | tok/s ratio |"
        " mem ratio |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  for r in results:
    b = base.get(r["preset"])
    ratio = r["tokens_per_s"] / b["tokens_per_s"] if b else float("nan")
    mem = (r["peak_bytes"] / b["peak_bytes"]
           if b and r["peak_bytes"] and b["peak_bytes"] else float("nan"))
    mfu = f"{r['mfu']:.1%}" if r["mfu"] else "-"
    peak = f"{r['peak_bytes'] / 2**30:.1f}" if r["peak_bytes"] else "-"
    plan = f"{r['xla_bytes'] / 2**30:.1f}" if r.get("xla_bytes") else "-"
    mark = "*" if r.get("timed_during_compiles") else ""
    print(f"| {r['preset']} | {r['scheme']}{mark} | {r['routing']} |"
          f" {r['grad_accum']} | {r['compile_s']:.0f} |"
          f" {r['step_s'] * 1e3:.1f} | {r['waited_step_s'] * 1e3:.1f} |"
          f" {r['tokens_per_s']:,.0f} | {mfu} | {peak} | {plan} | {ratio:.3f} |"
          f" {mem:.3f} |")
  import kernel_time
  for r in results:
    if r.get("profile"):
      print(kernel_time.format_breakdown(f"{r['preset']}/{r['scheme']}",
                                         r["profile"], r["step_s"] * 1e3))


if __name__ == "__main__":
  main()
