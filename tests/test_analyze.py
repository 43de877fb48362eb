"""mhar_jax.analyze: JS divergence numerically, and the command end to end on
tiny runs of the real trainer."""

import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from mhar_jax import analyze
from mhar_jax.config import base_config
from mhar_jax.summary import read_scalars

from helpers import make_trainer

ROOT = pathlib.Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def js_float64(p, q):
  """JS divergence (nats) of two distributions over axis 0, in float64."""
  p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
  m = 0.5 * (p + q)

  def kl(a, b):
    live = a > 0                                      # then b >= a / 2 > 0
    return np.sum(a * np.log(np.where(live, a, 1) / np.where(live, b, 1)),
                  axis=0)
  return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def pairwise_float64(w):
  """Mean over head pairs and tokens of ``[S, N, H]`` weights."""
  h = w.shape[-1]
  pairs = [js_float64(w[:, :, a], w[:, :, b])
           for a in range(h) for b in range(a + 1, h)]
  return float(np.mean(pairs)) if pairs else 0.0


def test_pairwise_js_matches_float64_formula():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(5, 3, 7, 4)) * 2.0        # [S, B, T, H]
  w = np.exp(logits) / np.exp(logits).sum(0, keepdims=True)
  w[0, 0, 0] = [1.0, 0.0, 0.5, 0.0]                   # exact zeros too
  w[1:, 0, 0] = [[0.0, 1.0, 0.5, 0.25]] + [[0.0, 0.0, 0.0, 0.75 / 3]] * 3
  got = float(analyze.pairwise_js(w.astype(np.float32)))
  want = pairwise_float64(w.reshape(5, -1, 4))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  # entropy per head against float64
  ent = np.asarray(analyze.head_entropy(w.astype(np.float32)))
  ref = np.mean(-np.sum(np.where(w > 0, w * np.log(np.where(w > 0, w, 1)), 0),
                        axis=0), axis=(0, 1))
  np.testing.assert_allclose(ent, ref, rtol=1e-5, atol=1e-6)


def test_pairwise_js_limits():
  rng = np.random.default_rng(1)
  p = rng.dirichlet(np.ones(6), size=(2, 3)).transpose(2, 0, 1)  # [6, 2, 3]
  same = np.repeat(p[..., None], 4, axis=-1).astype(np.float32)
  assert float(analyze.pairwise_js(same)) == 0.0
  onehot = np.zeros((3, 5, 2), np.float32)            # [S, N, H] disjoint
  onehot[0, :, 0] = 1.0
  onehot[2, :, 1] = 1.0
  np.testing.assert_allclose(float(analyze.pairwise_js(onehot)), math.log(2),
                             rtol=1e-6)
  assert float(analyze.pairwise_js(p[..., :1].astype(np.float32))) == 0.0
  s = analyze.routing_summary([same[:3, ..., :2], onehot])
  np.testing.assert_allclose(np.asarray(s["js"]), [0.0, math.log(2)],
                             rtol=1e-6, atol=1e-7)


def tiny_config(residual="mhar", num_blocks=0, steps=3):
  c = base_config()
  c.model.update(vocab_size=2048, d_model=32, num_layers=2, num_heads=2,
                 num_kv_heads=1, head_dim=16, ffn_dim=64, max_seq_len=32,
                 residual=residual, routing_heads=2, num_blocks=num_blocks,
                 dtype="float32")
  c.train.update(steps=steps, global_batch=4, seq_len=32, lr=3e-2,
                 warmup_steps=1)
  c.eval.update(every=1000, batches=1)
  c.checkpoint.update(every=1000, keep=1, async_save=False)
  c.log.update(every=1000, routing_every=1000)
  return c


@pytest.mark.parametrize("num_blocks", [0, 2])
def test_analyze_end_to_end(tmp_path, capsys, num_blocks):
  cfg = tiny_config(num_blocks=num_blocks)
  result = make_trainer(cfg, tmp_path).run()
  assert analyze.main(["--workdir", str(tmp_path), "--batches", "1",
                       "--batch", "3"]) == 0
  printed = capsys.readouterr().out
  assert "site" in printed and "analysis.json" in printed
  out = tmp_path / "analysis"
  for name in ("depth_attention.png", "head_divergence.png"):
    assert (out / name).read_bytes()[:8] == PNG_MAGIC
  a = json.loads((out / "analysis.json").read_text())
  assert a["step"] == 3 and a["scheme"] == "mhar" and a["heads"] == 2
  assert a["tokens"] == 3 * 32 and a["num_sites"] == 2 * 2 + 1
  sources = [1, 2, 3, 4, 5] if num_blocks == 0 else [1, 2, 2, 3, 3]
  assert [len(m) for m in a["maps"]] == sources == a["sources"]
  for m in a["maps"]:
    np.testing.assert_allclose(np.sum(m, axis=0), 1.0, atol=1e-5)
  assert len(a["js"]) == len(a["js_of_means"]) == 5
  assert np.asarray(a["entropy"]).shape == (5, 2)

  # Independently: the trained parameters, the first validation batch.
  from flax import nnx

  from mhar_jax import training
  from mhar_jax.config import model_config
  from mhar_jax.data import make_eval_batches, resolve_data_dir
  gdef = training.graphdef(model_config(cfg))
  inputs = next(make_eval_batches(resolve_data_dir(""), "val", seq_len=32,
                                  batch=3))["inputs"]
  routing = jax.jit(lambda p, x: nnx.merge(gdef, p)(x, return_routing=True)[1])(
      jax.device_get(result["state"]["params"]), inputs)
  for j, w in enumerate(routing):
    w = np.asarray(w, np.float64)                     # [S_j, B, T, H]
    np.testing.assert_allclose(a["maps"][j], w.mean(axis=(1, 2)), atol=1e-5)
    np.testing.assert_allclose(
        a["js"][j], pairwise_float64(w.reshape(w.shape[0], -1, w.shape[-1])),
        rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(
        a["js_of_means"][j],
        pairwise_float64(w.mean(axis=(1, 2))[:, None, :]), rtol=1e-4,
        atol=1e-6)
  assert max(a["js"]) > 0                             # the heads did move apart

  tb = read_scalars(str(tmp_path / "tensorboard"))
  assert [v for _, v in tb["analysis/js_site_004"]] == pytest.approx(
      [a["js"][4]])
  from tensorboard.backend.event_processing import event_file_loader
  images = {v.tag for name in os.listdir(tmp_path / "tensorboard")
            for ev in event_file_loader.EventFileLoader(
                str(tmp_path / "tensorboard" / name)).Load()
            for v in ev.summary.value
            if v.HasField("image") or v.metadata.plugin_data.plugin_name
            == "images"}
  assert images == {"analysis/depth_attention", "analysis/head_divergence"}


def run_analyze(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, "-m", "mhar_jax.analyze", *args],
                        cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=120, check=False)


def test_prenorm_run_is_refused(tmp_path):
  make_trainer(tiny_config(residual="prenorm", steps=1), tmp_path).run()
  r = run_analyze("--workdir", str(tmp_path))
  assert r.returncode == 1
  assert "model.residual='prenorm'" in r.stderr, r.stderr[-2000:]
  assert not (tmp_path / "analysis").exists()
  r = run_analyze("--workdir", str(tmp_path / "none"))
  assert r.returncode == 1 and "no checkpoint" in r.stderr, r.stderr[-2000:]
