"""The residual-scheme comparison on the benchmark corpus (issue: reproduce the paper).

    python experiments/compare.py run --root workdirs/compare [--runs all]
        [--jobs 2] [--config configs/bench100m.py] [--steps N]
        [--analyze mhar_h8] [--delta_demo STEPS] [--pack OUT.tar.gz]
    python experiments/compare.py report --root workdirs/compare
        [--out experiments/results] [--throughput tp.json]

``run`` trains every named run with ``python -m mhar_jax.train`` (same config,
data order and token budget; only the scheme, and for the ``_seed1`` runs the
seed, differ), ``--jobs`` at a time on the one device (each gets
``0.9 / jobs`` of its memory; the logged tokens/s are then shared-device
figures, not the scheme's speed: take speed from benchmarks/throughput.py).
Each run's console log is ``ROOT/NAME/train.log`` and its command
``ROOT/NAME/command.txt``. ``--analyze NAME`` runs ``python -m
mhar_jax.analyze`` on that run when it is done. ``--delta_demo STEPS``
continues the finished ``--delta_demo_base`` run (default ``prenorm``) for
STEPS steps twice from its final checkpoint, one after the other in that
run's job slot: converted to the delta scheme and unchanged (both through
``python -m mhar_jax.convert``; fresh optimiser, the mid-training recipe of
``DEMO_OVERRIDES``). ``--pack`` re-writes a tarball of everything but the
checkpoints after every finished run, so a run cut short still reports what
it finished.

``report`` reads the TensorBoard events of every finished run and writes
``table.md`` (final validation loss and bits per byte per split, tokens/s),
``loss_vs_heads.png``, ``loss_curves.png``, ``routing_entropy.png`` and
``summary.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import subprocess
import sys
import tarfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> config overrides; the order is the order of priority.
RUNS = {
    "prenorm": {"model.residual": "prenorm"},
    "attnres": {"model.residual": "attnres"},
    "mhar_h8": {"model.residual": "mhar", "model.routing_heads": 8},
    "hyper": {"model.residual": "hyper"},
    "mhar_h4": {"model.residual": "mhar", "model.routing_heads": 4},
    "mhar_h8_b8": {"model.residual": "mhar", "model.routing_heads": 8,
                   "model.num_blocks": 8},
    "mhar_h2": {"model.residual": "mhar", "model.routing_heads": 2},
    "mhar_h16": {"model.residual": "mhar", "model.routing_heads": 16},
    "prenorm_seed1": {"model.residual": "prenorm", "train.seed": 1},
    "attnres_seed1": {"model.residual": "attnres", "train.seed": 1},
    "mhar_h8_seed1": {"model.residual": "mhar", "model.routing_heads": 8,
                      "train.seed": 1},
    "mhar_h4_seed1": {"model.residual": "mhar", "model.routing_heads": 4,
                      "train.seed": 1},
}

# Continued training of the delta demonstration (the paper's mid-training
# recipe: re-warm-up to 4e-4, weight decay 0.05, z-loss 1e-4) on a data order
# the base run did not use.
DEMO_OVERRIDES = {"train.lr": 4e-4, "train.weight_decay": 0.05,
                  "train.z_loss": 1e-4, "train.seed": 2}
SPLITS = ("val", "val_prose", "val_code")


def train_command(config: str, workdir: str, overrides: dict) -> list[str]:
  return ([sys.executable, "-m", "mhar_jax.train", f"--config={config}",
           f"--workdir={workdir}"]
          + [f"--config.{k}={v}" for k, v in overrides.items()])


def run_logged(cmd: list[str], workdir: str, env: dict, log_name="train.log"
               ) -> dict:
  """Runs ``cmd`` with its output in ``workdir/log_name``; returns a record."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "command.txt"), "a") as f:
    f.write(" ".join(cmd) + "\n")
  t0 = time.time()
  with open(os.path.join(workdir, log_name), "a") as log:
    rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                         cwd=ROOT)
  return {"returncode": rc, "wall_s": time.time() - t0}


class Runner:
  """Runs jobs ``jobs`` at a time and re-packs the results after each."""

  def __init__(self, root: str, jobs: int, pack: str):
    self.root, self.jobs, self.pack = root, jobs, pack
    self.env = dict(os.environ, PYTHONUNBUFFERED="1",
                    XLA_PYTHON_CLIENT_MEM_FRACTION=f"{0.9 / jobs:.2f}")
    self.t0 = time.time()
    self.lock = threading.Lock()

  def say(self, msg):
    with self.lock:
      print(f"[{time.time() - self.t0:6.0f}s] {msg}", flush=True)

  def train(self, name: str, config: str, overrides: dict,
            residual: str = "") -> bool:
    wd = os.path.join(self.root, name)
    self.say(f"{name}: start")
    r = run_logged(train_command(config, wd, overrides), wd, self.env)
    with open(os.path.join(wd, "run.json"), "w") as f:
      json.dump(dict(r, name=name, config=config, overrides=overrides,
                     residual=residual or overrides["model.residual"]), f)
    tail = open(os.path.join(wd, "train.log")).read().splitlines()[-3:]
    self.say(f"{name}: exit {r['returncode']} after {r['wall_s']:.0f}s | "
             + " | ".join(tail))
    self.repack()
    return r["returncode"] == 0

  def step(self, name: str, cmd: list[str], log_name: str) -> bool:
    wd = os.path.join(self.root, name)
    r = run_logged(cmd, wd, self.env, log_name)
    self.say(f"{name}: {' '.join(cmd[1:4])} ... exit {r['returncode']}")
    self.repack()
    return r["returncode"] == 0

  def repack(self):
    if not self.pack:
      return
    with self.lock:
      tmp = self.pack + ".tmp"
      with tarfile.open(tmp, "w:gz") as tar:
        tar.add(self.root, arcname=os.path.basename(self.root),
                filter=lambda ti: None if "/checkpoints" in ti.name else ti)
      os.replace(tmp, self.pack)


def cmd_run(a):
  names = list(RUNS) if a.runs == "all" else a.runs.split(",")
  for n in names:
    if n not in RUNS:
      sys.exit(f"compare.py: --runs: unknown run {n!r}; choose from"
               f" {', '.join(RUNS)}.")
  if a.delta_demo and (a.delta_demo_base not in names or
                       RUNS[a.delta_demo_base]["model.residual"] != "prenorm"):
    sys.exit(f"compare.py: --delta_demo_base={a.delta_demo_base!r} must be a"
             " prenorm run named in --runs.")
  root = os.path.abspath(a.root)
  runner = Runner(root, a.jobs, a.pack and os.path.abspath(a.pack))
  extra = dict(kv.split("=", 1) for kv in a.set)
  if a.steps:
    extra["train.steps"] = a.steps

  def one(name):
    ok = runner.train(name, a.config, {**RUNS[name], **extra})
    if ok and name in a.analyze.split(","):
      runner.step(name, [sys.executable, "-m", "mhar_jax.analyze",
                         f"--workdir={os.path.join(root, name)}"],
                  "analyze.log")
    if ok and name == a.delta_demo_base and a.delta_demo:
      delta_demo(runner, root, name, a.delta_demo, extra)
    return ok

  with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
    done = list(pool.map(one, names))
  runner.say(f"finished: {sum(done)}/{len(done)} runs succeeded")
  runner.repack()


def delta_demo(runner: Runner, root: str, base: str, steps: int, extra: dict):
  """Continues ``root/base`` as ``demo_delta`` and ``demo_plain``."""
  base = os.path.join(root, base)
  overrides = {**DEMO_OVERRIDES, "train.steps": steps,
               "train.warmup_steps": steps // 20,
               **{k: v for k, v in extra.items() if k != "train.steps"}}

  def branch(name, residual):
    dst = os.path.join(root, name)
    conv = [sys.executable, "-m", "mhar_jax.convert", f"--from={base}",
            f"--to={dst}", f"--residual={residual}"]
    if residual == "delta":
      conv += ["--routing_heads=8", "--num_blocks=8"]
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    log = os.path.join(root, f"{name}.convert.log")
    with open(log, "w") as f:
      rc = subprocess.call(conv, stdout=f, stderr=subprocess.STDOUT,
                           env=runner.env, cwd=ROOT)
    runner.say(f"{name}: convert exit {rc}")
    if rc == 0:
      runner.train(name, os.path.join(dst, "config.py"), overrides, residual)

  # In turn: this thread holds one of the --jobs slots of the device.
  branch("demo_delta", "delta")
  branch("demo_plain", "prenorm")


# -- report ------------------------------------------------------------------------

def read_run(wd: str) -> dict | None:
  from mhar_jax.summary import read_scalars
  tb = os.path.join(wd, "tensorboard")
  if not os.path.isdir(tb):
    return None
  s = read_scalars(tb)
  if "eval/val/loss" not in s:
    return None
  info = json.load(open(os.path.join(wd, "run.json")))
  tok = [v for _, v in s.get("train/tokens_per_s", [])[1:]]
  ent = sorted((k, v[-1][1]) for k, v in s.items()
               if k.startswith("routing/entropy_site_"))
  out = {"name": os.path.basename(wd), "overrides": info["overrides"],
         "routing_entropy": [v for _, v in ent],
         "residual": info["residual"],
         "command": open(os.path.join(wd, "command.txt")).read().strip(),
         "step": s["eval/val/loss"][-1][0],
         "train_loss": s.get("train/loss", []),
         "eval_loss": s["eval/val/loss"],
         "tokens_per_s_logged": sorted(tok)[len(tok) // 2] if tok else None}
  for split in SPLITS:
    for k in ("loss", "bpb"):
      if f"eval/{split}/{k}" in s:
        out[f"{split}/{k}"] = s[f"eval/{split}/{k}"][-1][1]
  return out


def scheme_label(r: str, ov: dict) -> tuple[str, str]:
  h = ov.get("model.routing_heads")
  label = {"prenorm": "pre-norm", "hyper": "Hyper-Conn. (n=4)",
           "attnres": "AttnRes", "mhar": "MHAR", "delta": "delta MHAR"}[r]
  if ov.get("model.num_blocks"):
    label = f"Block {label} ({ov['model.num_blocks']} blocks)"
  heads = "1" if r == "attnres" else (str(h) if h else "-")
  return label, heads


def cmd_report(a):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  root = os.path.abspath(a.root)
  order = {n: i for i, n in enumerate(RUNS)}
  runs = [r for n in sorted(os.listdir(root), key=lambda n: (order.get(n, 99), n))
          if os.path.isdir(os.path.join(root, n))
          and (r := read_run(os.path.join(root, n)))]
  if not runs:
    sys.exit(f"compare.py report: no finished runs under {root}.")
  tp = {}
  if a.throughput:
    for r in json.load(open(a.throughput)):
      if r["preset"] == a.throughput_preset:
        tp[r["scheme"]] = r["tokens_per_s"]
  bench = {"prenorm": "prenorm", "hyper": "hyper", "attnres": "attnres",
           "mhar_h8": "mhar", "mhar_h8_b8": "mhar_b8"}
  os.makedirs(a.out, exist_ok=True)
  # Δ against the pre-norm run of the same seed (same data order); the
  # demonstration's delta run against its plain continuation.
  base_of = {r["overrides"].get("train.seed", 0): r for r in runs
             if r["residual"] == "prenorm" and not r["name"].startswith("demo_")}
  demo_plain = next((r for r in runs if r["name"] == "demo_plain"), None)
  # ... and against the AttnRes run of the same seed (the run named
  # ``attnres`` / ``attnres_seed1``).
  attnres_of = {r["overrides"].get("train.seed", 0): r for r in runs
                if r["name"] in ("attnres", "attnres_seed1")}
  base = base_of.get(0)
  lines = ["| run | scheme | H | seed | tokens | val loss | Δ vs pre-norm |"
           " Δ vs AttnRes | bpb val | bpb prose | bpb code | tokens/s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in runs:
    ov = r["overrides"]
    label, heads = scheme_label(r["residual"], ov)
    tokens = r["step"] * a.tokens_per_step
    ref = (demo_plain if r["name"].startswith("demo_") else
           base_of.get(ov.get("train.seed", 0)))
    delta = f"{r['val/loss'] - ref['val/loss']:+.4f}" if ref else "-"
    att = attnres_of.get(ov.get("train.seed", 0))
    vs_att = (f"{r['val/loss'] - att['val/loss']:+.4f}"
              if att and not r["name"].startswith("demo_") else "-")
    speed = tp.get(bench.get(r["name"], ""))
    speed = f"{speed:,.0f}" if speed else "-"
    lines.append(
        f"| {r['name']} | {label} | {heads} | {ov.get('train.seed', 0)} |"
        f" {tokens / 1e6:.1f}M | {r['val/loss']:.4f} | {delta} | {vs_att} |"
        f" {r.get('val/bpb', float('nan')):.4f} |"
        f" {r.get('val_prose/bpb', float('nan')):.4f} |"
        f" {r.get('val_code/bpb', float('nan')):.4f} | {speed} |")
  table = "\n".join(lines)
  with open(os.path.join(a.out, "table.md"), "w") as f:
    f.write(table + "\n\nCommands:\n\n" + "\n".join(
        f"- {r['name']}: `{r['command']}`" for r in runs) + "\n")
  print(table)

  # loss vs H (seed 0, full MHAR, with AttnRes as H = 1)
  pts = sorted((1 if r["name"] == "attnres" else
                int(r["overrides"]["model.routing_heads"]), r["val/loss"])
               for r in runs if r["name"] == "attnres"
               or (r["name"].startswith("mhar_h") and "_b" not in r["name"]
                   and "seed" not in r["name"]))
  fig, ax = plt.subplots(figsize=(5, 3.5))
  if pts:
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="MHAR (H=1: AttnRes)")
    ax.set_xscale("log", base=2)
  if base:
    ax.axhline(base["val/loss"], color="gray", ls="--", label="pre-norm")
  if base_of.get(1):
    ax.axhline(base_of[1]["val/loss"], color="C3", ls=":", lw=1,
               label="pre-norm, seed 1")
  for r in runs:
    if r["name"].endswith("_seed1"):
      h = 1 if "attnres" in r["name"] else r["overrides"].get("model.routing_heads")
      if h:
        ax.plot([h], [r["val/loss"]], "x", color="C3",
                label="seed 1" if "seed 1" not in ax.get_legend_handles_labels()[1] else None)
  ax.set_xlabel("routing heads H")
  ax.set_ylabel("validation loss (nats)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(a.out, "loss_vs_heads.png"), dpi=120)

  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for r in runs:
    if r["name"].startswith("demo_"):
      continue
    st = [s for s, _ in r["train_loss"]]
    ls = [v for _, v in r["train_loss"]]
    axes[0].plot(st, ls, lw=1, label=r["name"])
    tail = [(s, v) for s, v in r["train_loss"] if s >= 0.5 * r["step"]]
    axes[1].plot([s for s, _ in tail], [v for _, v in tail], lw=1,
                 label=r["name"])
  axes[0].set_ylim(top=8)
  for ax in axes:
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
  axes[1].set_title("second half")
  axes[1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(a.out, "loss_curves.png"), dpi=120)
  # routing entropy per site, relative to uniform over the site's sources
  fig, ax = plt.subplots(figsize=(6, 3.5))
  for r in runs:
    full = not r["overrides"].get("model.num_blocks")
    if (r["routing_entropy"] and full and "seed" not in r["name"]
        and not r["name"].startswith("demo_")):
      rel = [e / math.log(j + 1) for j, e in enumerate(r["routing_entropy"])
             if j > 0]
      ax.plot(range(1, len(rel) + 1), rel, lw=1.2, label=r["name"])
  ax.set_xlabel("routing site j (reads j+1 sources)")
  ax.set_ylabel("entropy / ln(j+1)")
  ax.set_title("routing entropy at the end (1 = uniform)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(a.out, "routing_entropy.png"), dpi=120)
  with open(os.path.join(a.out, "summary.json"), "w") as f:
    json.dump(runs, f, indent=1)
  print(f"wrote {a.out}/table.md, loss_vs_heads.png, loss_curves.png,"
        " routing_entropy.png, summary.json")


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = ap.add_subparsers(dest="cmd", required=True)
  r = sub.add_parser("run")
  r.add_argument("--root", default="workdirs/compare")
  r.add_argument("--runs", default="all", help=f"comma list of {list(RUNS)}")
  r.add_argument("--jobs", type=int, default=2)
  r.add_argument("--config", default="configs/bench100m.py")
  r.add_argument("--steps", type=int, default=0, help="override train.steps")
  r.add_argument("--set", action="append", default=[],
                 help="extra override KEY=VALUE for every run")
  r.add_argument("--analyze", default="", help="runs to analyse when done")
  r.add_argument("--delta_demo", type=int, default=0,
                 help="steps of the delta demonstration (0: none)")
  r.add_argument("--delta_demo_base", default="prenorm",
                 help="the prenorm run the demonstration continues")
  r.add_argument("--pack", default="", help="tarball of the results")
  p = sub.add_parser("report")
  p.add_argument("--root", default="workdirs/compare")
  p.add_argument("--out", default="experiments/results")
  p.add_argument("--throughput", default="",
                 help="benchmarks/throughput.py --json output for tokens/s")
  p.add_argument("--throughput_preset", default="bench100m")
  p.add_argument("--tokens_per_step", type=int, default=32 * 2048)
  a = ap.parse_args()
  sys.path.insert(0, ROOT)
  (cmd_run if a.cmd == "run" else cmd_report)(a)


if __name__ == "__main__":
  main()
