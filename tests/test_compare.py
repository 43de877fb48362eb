"""experiments/compare.py end to end on the tiny config: runs, delta demo, report."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_compare_runs_demo_and_report(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  root, out = tmp_path / "runs", tmp_path / "report"
  run = subprocess.run(
      [sys.executable, "experiments/compare.py", "run", f"--root={root}",
       "--config=configs/tiny.py", "--runs=prenorm", "--jobs=1", "--steps=3",
       "--set", "train.warmup_steps=1", "--delta_demo=2",
       f"--pack={tmp_path / 'pack.tgz'}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stdout + run.stderr
  assert "finished: 1/1 runs succeeded" in run.stdout
  assert (tmp_path / "pack.tgz").exists()
  rep = subprocess.run(
      [sys.executable, "experiments/compare.py", "report", f"--root={root}",
       f"--out={out}", "--tokens_per_step=2048"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert rep.returncode == 0, rep.stdout + rep.stderr
  table = (out / "table.md").read_text()
  rows = {l.split("|")[1].strip(): l for l in table.splitlines()
          if l.startswith("| ") and not l.startswith("| run")}
  assert set(rows) == {"prenorm", "demo_delta", "demo_plain"}
  summary = json.loads((out / "summary.json").read_text())
  by = {r["name"]: r for r in summary}
  assert by["prenorm"]["step"] == 3 and by["demo_delta"]["step"] == 2
  assert by["demo_delta"]["residual"] == "delta"
  for name in ("loss_vs_heads.png", "loss_curves.png", "routing_entropy.png"):
    assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # the delta run starts from the converted base: its command names its config
  assert "demo_delta/config.py" in by["demo_delta"]["command"]
