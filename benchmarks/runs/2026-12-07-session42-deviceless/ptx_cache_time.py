"""Cold-start compile time of one run with and without the PTX cache
(mhar_jax/kernels/ptx_cache.py) and JAX's executable cache, for an H200
without one (benchmarks/h200_aot.py). From the repository root, in the
deviceless venv: python benchmarks/runs/2026-12-07-session42-deviceless/ptx_cache_time.py 1b/mhar
Four child processes, one after another: A both caches empty; B both filled
by A; D A's executables without its PTX; C A's PTX without its executables."""
import os, shutil, subprocess, sys, time
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../.."))
sys.path.insert(0, ROOT + "/benchmarks")
import throughput
run = sys.argv[1]
preset, _, scheme = run.partition("/")
base = "/tmp/ptx_cache_time/c"
def child(cache, label):
  env = throughput.child_env(False, run)
  env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.92"
  code = ("import sys; sys.path.insert(0, %r); import h200_aot; d = h200_aot.setup()\n"
          "import throughput; throughput.child(%r, %r, 0, 0, 32768, 'auto', %r, True, devices=d)"
          % (ROOT + "/benchmarks", preset, scheme, cache))
  t0 = time.time()
  p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
  lines = [l for l in p.stderr.splitlines() if "compiled in" in l]
  n = len(os.listdir(os.path.join(cache, "mhar_jax_ptx"))) if os.path.isdir(os.path.join(cache, "mhar_jax_ptx")) else 0
  print(f"{label}: rc {p.returncode}, wall {time.time()-t0:.1f}s, ptx entries {n}; " + " | ".join(lines), flush=True)
  if p.returncode: print(p.stderr[-3000:])
shutil.rmtree(base, ignore_errors=True)
child(base + "A", "A fresh (XLA compile + Triton compile)")
child(base + "A", "B both caches")
shutil.copytree(base + "A", base + "D", ignore=shutil.ignore_patterns("mhar_jax_ptx"))
child(base + "D", "D XLA cache only (the old way)")
os.makedirs(base + "C"); shutil.copytree(base + "A/mhar_jax_ptx", base + "C/mhar_jax_ptx")
child(base + "C", "C PTX cache only")
