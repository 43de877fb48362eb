"""The trainer end to end on the shipped tiny corpus: resume, faults, multi-host."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from mhar_jax.config import base_config, validate
from mhar_jax.summary import read_scalars

from helpers import make_trainer

ROOT = pathlib.Path(__file__).resolve().parents[1]


def tiny_config(**train):
  c = base_config()
  c.model.update(vocab_size=2048, d_model=32, num_layers=1, num_heads=2,
                 num_kv_heads=1, head_dim=16, ffn_dim=64, max_seq_len=32,
                 residual="mhar", routing_heads=2, dtype="float32")
  c.train.update(steps=8, global_batch=4, seq_len=32, lr=3e-3, warmup_steps=2)
  c.train.update(**train)
  c.eval.update(every=1000, batches=2)
  c.checkpoint.update(every=4, keep=2, async_save=True)
  c.log.update(every=2, routing_every=4)
  return c


def params_of(result):
  return jax.tree.leaves(jax.device_get(result["state"]["params"]))


def test_resume_is_bit_identical(tmp_path):
  straight = make_trainer(tiny_config(), tmp_path / "a").run()
  first = make_trainer(tiny_config(), tmp_path / "b").run(until=4)
  second = make_trainer(tiny_config(), tmp_path / "b").run()
  assert first["step"] == 4 and second["step"] == 8
  assert straight["train_history"] == first["train_history"] + second["train_history"]
  for a, b in zip(params_of(straight), params_of(second)):
    np.testing.assert_array_equal(a, b)
  assert straight["val/loss"] == second["val/loss"]
  tb = read_scalars(str(tmp_path / "a" / "tensorboard"))
  for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s",
              "eval/val/loss", "eval/val/bpb", "routing/entropy_site_000"):
    assert tag in tb, sorted(tb)


def test_nonfinite_stop_keeps_parameters(tmp_path):
  cfg = tiny_config(lr=1e38, warmup_steps=0, clip_norm=1e38)
  cfg.model.init_std = 1e19                    # logits overflow to inf
  with pytest.raises(FloatingPointError, match="train.nonfinite='stop'"):
    make_trainer(cfg, tmp_path).run()


def test_nonfinite_skip_counts_and_stops_after_k(tmp_path):
  cfg = tiny_config(nonfinite="skip", max_consecutive_skips=3, steps=8)
  cfg.model.init_std = 1e19
  with pytest.raises(FloatingPointError, match="consecutive non-finite steps"):
    make_trainer(cfg, tmp_path).run()
  cfg = tiny_config(nonfinite="skip", max_consecutive_skips=100, steps=4)
  cfg.model.init_std = 1e19
  trainer = make_trainer(cfg, tmp_path / "skip")
  res = trainer.run()
  assert int(res["state"]["skipped"]) == 4
  from mhar_jax import training
  init = training.init_state(trainer.model_cfg, trainer.tx, 0, trainer.state_sh)
  for a, b in zip(jax.tree.leaves(init["params"]), params_of(res)):
    np.testing.assert_array_equal(a, b)          # no update was applied


def test_validation_names_key_and_value(tmp_path):
  with pytest.raises(ValueError, match=r"mesh.data=3"):
    c = tiny_config(); c.mesh.data = 3; validate(c, num_devices=4)
  with pytest.raises(ValueError, match=r"train.global_batch=6"):
    validate(tiny_config(global_batch=6), num_devices=4)
  with pytest.raises(ValueError, match=r"train.seq_len=64"):
    validate(tiny_config(seq_len=64), num_devices=1)
  with pytest.raises(ValueError, match=r"model.num_heads=2 .*mesh.model=4"):
    c = tiny_config(); c.mesh.model = 4; validate(c, num_devices=4)
  from mhar_jax.train import resolve_data
  c = tiny_config(); c.data.data_dir = str(tmp_path / "nope")
  with pytest.raises(ValueError, match="data.data_dir"):
    resolve_data(c, validate(c, num_devices=1))
  c = tiny_config(); c.model.vocab_size = 1000
  with pytest.raises(ValueError, match=r"model.vocab_size=1000"):
    resolve_data(c, validate(c, num_devices=1))
  tok = ROOT / "mhar_jax" / "data" / "assets" / "tiny_tokenizer.json"
  c = tiny_config(); c.model.vocab_size = 1000; c.data.tokenizer = str(tok)
  with pytest.raises(ValueError, match=r"data.tokenizer=.*2048 tokens.*model.vocab_size=1000"):
    validate(c, num_devices=1)
  # recompute_site_outputs: a share of the sites; True / False in a config
  # file are all / none
  for share, want in ((True, 1.0), (False, 0.0), (0.5, 0.5)):
    c = tiny_config(); c.model.recompute_site_outputs = share
    assert validate(c, num_devices=1).recompute_site_outputs == want
  c = tiny_config(); c.model.recompute_site_outputs = 1.5
  with pytest.raises(ValueError, match=r"model.recompute_site_outputs=1.5"):
    validate(c, num_devices=1)


def run_cli(*args, timeout=240, env=None):
  e = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
  e.pop("XLA_FLAGS", None)
  e.update(env or {})
  return subprocess.run([sys.executable, "-m", "mhar_jax.train", *args],
                        cwd=ROOT, env=e, capture_output=True, text=True,
                        timeout=timeout)


TINY_FLAGS = ["--config=configs/tiny.py", "--config.model.d_model=32",
              "--config.model.num_layers=1", "--config.model.num_heads=2",
              "--config.model.num_kv_heads=2", "--config.model.head_dim=16",
              "--config.model.ffn_dim=64", "--config.model.routing_heads=2",
              "--config.train.seq_len=32", "--config.train.global_batch=4",
              "--config.eval.batches=2", "--config.log.every=2"]


def test_cli_rejects_unknown_key_and_bad_value(tmp_path):
  r = run_cli("--config=configs/tiny.py", "--config.train.stepz=3",
              f"--workdir={tmp_path}", timeout=120)
  assert r.returncode != 0 and "stepz" in r.stderr
  r = run_cli("--config=configs/tiny.py", "--config.model.routing_heads=3",
              f"--workdir={tmp_path}", timeout=120)
  assert r.returncode != 0 and "model.routing_heads=3" in r.stderr
  assert not (tmp_path / "checkpoints").exists()


def test_dry_run_prints_the_plan():
  r = run_cli(*TINY_FLAGS, "--dry_run", "--dry_run_devices=4",
              "--config.mesh.model=2")
  assert r.returncode == 0, r.stderr[-3000:]
  for needle in ("parameters", "FLOPs/token", "data=2 model=2",
                 "temporaries", "peak (est.)"):
    assert needle in r.stdout, r.stdout


@pytest.mark.slow
def test_sigterm_saves_exits_zero_and_resumes_bit_identically(tmp_path):
  flags = [*TINY_FLAGS, "--config.train.steps=40", "--config.train.warmup_steps=2",
           "--config.checkpoint.every=100000", "--config.eval.every=100000"]
  e = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
  e.pop("XLA_FLAGS", None)
  p = subprocess.Popen([sys.executable, "-m", "mhar_jax.train", *flags,
                        f"--workdir={tmp_path / 'stopped'}"], cwd=ROOT, env=e,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
  try:
    for line in p.stdout:
      if line.startswith("step"):
        break
    p.send_signal(signal.SIGTERM)
    t0 = time.time()
    out, _ = p.communicate(timeout=60)
  finally:
    p.kill()
  assert p.returncode == 0, out[-2000:]
  assert time.time() - t0 < 60
  assert "stop requested" in out
  ckpts = tmp_path / "stopped" / "checkpoints"
  steps = [int(d) for d in os.listdir(ckpts) if d.isdigit()]
  assert steps and 0 < max(steps) < 40, steps
  resumed = run_cli(*flags, f"--workdir={tmp_path / 'stopped'}")
  assert resumed.returncode == 0 and "resumed from step" in resumed.stdout, (
      resumed.stdout[-2000:] + resumed.stderr[-3000:])
  straight = run_cli(*flags, f"--workdir={tmp_path / 'straight'}")
  assert straight.returncode == 0, straight.stderr[-2000:]
  a = read_scalars(str(tmp_path / "stopped" / "tensorboard"))
  b = read_scalars(str(tmp_path / "straight" / "tensorboard"))
  assert a["eval/val/loss"][-1] == b["eval/val/loss"][-1] == b["eval/val/loss"][0]
  assert a["train/loss"][-1] == b["train/loss"][-1]
  assert a["train/loss"][-1][0] == 40


MULTI_FLAGS = TINY_FLAGS + ["--config.train.steps=6", "--config.train.warmup_steps=2", "--config.train.global_batch=8",
                            "--config.eval.every=1000", "--config.checkpoint.every=1000"]


@pytest.mark.slow
def test_two_processes_match_one_process_with_four_devices(tmp_path):
  import portpicker
  port = portpicker.pick_unused_port()
  env2 = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  procs = [subprocess.Popen(
      [sys.executable, "-m", "mhar_jax.train", *MULTI_FLAGS,
       f"--workdir={tmp_path / 'multi'}", f"--coordinator_address=localhost:{port}",
       "--num_processes=2", f"--process_id={i}"], cwd=ROOT,
      env=dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", **env2),
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(2)]
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=300)[0])
  finally:
    for p in procs:
      p.kill()
  assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
  single = run_cli(*MULTI_FLAGS, f"--workdir={tmp_path / 'single'}",
                   env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
  assert single.returncode == 0, single.stderr[-3000:]
  a = read_scalars(str(tmp_path / "multi" / "tensorboard"))["train/loss"]
  b = read_scalars(str(tmp_path / "single" / "tensorboard"))["train/loss"]
  assert [s for s, _ in a] == [s for s, _ in b] == [2, 4, 6]
  np.testing.assert_allclose([v for _, v in a], [v for _, v in b], rtol=1e-5)


def test_resuming_another_architecture_fails_at_start(tmp_path):
  r = run_cli(*TINY_FLAGS, "--config.train.steps=2", "--config.train.warmup_steps=1",
              "--config.eval.every=1000", f"--workdir={tmp_path}")
  assert r.returncode == 0, r.stderr[-3000:]
  r = run_cli(*TINY_FLAGS, "--config.train.steps=4", "--config.train.warmup_steps=1",
              "--config.model.num_layers=2", f"--workdir={tmp_path}")
  assert r.returncode != 0
  assert "model.num_layers: checkpoint 1, config 2" in r.stderr, r.stderr[-2000:]
  assert "Traceback" not in r.stderr


def test_fingerprint_leaves_out_implementation_choices():
  """A run resumes with another routing implementation or memory trade
  (recomputation, rematerialization); another architecture does not."""
  from mhar_jax import training
  base = training.fingerprint(validate(tiny_config(), num_devices=1))
  for key, value in (("routing_impl", "reference"), ("routing_backward", "site"),
                     ("remat", True), ("recompute_sources", "attention"),
                     ("recompute_site_outputs", 1.0)):
    c = tiny_config(); c.model[key] = value
    assert training.fingerprint(validate(c, num_devices=1)) == base, key
  c = tiny_config(); c.model.routing_heads = 1
  assert training.fingerprint(validate(c, num_devices=1)) != base
