"""Model conversion to the delta scheme: identity at step 0, errors, resume.

Sources: a prenorm run of this project (trained two steps by the Trainer) and
tiny random Hugging Face Llama / Qwen3 checkpoints written by ``transformers``
(skipped when torch / transformers are absent), compared with the
``transformers`` forward on CPU. All float32, logits to 1e-5.
"""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from mhar_jax import convert, parallel, training
from mhar_jax.checkpoint import Checkpointer
from mhar_jax.config import base_config, model_config
from mhar_jax.layers import Transformer, TransformerConfig

from helpers import make_trainer

TOL = 1e-5


def prenorm_config(**train):
  c = base_config()
  c.model.update(vocab_size=2048, d_model=32, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=8, ffn_dim=64, max_seq_len=32,
                 residual="prenorm", dtype="float32")
  c.train.update(steps=2, global_batch=4, seq_len=32, lr=3e-3, warmup_steps=1)
  c.train.update(**train)
  c.eval.update(every=1000, batches=1)
  c.checkpoint.update(every=2, keep=2, async_save=False)
  c.log.update(every=1, routing_every=1000)
  return c


def restore_converted(workdir):
  """(model config, state, meta) of a converted workdir, restored the way the
  trainer does (its config.py, abstract state with shardings, fingerprint)."""
  cfg = convert.load_config_file(os.path.join(workdir, "config.py"))
  m = model_config(cfg)
  tx = training.make_optimizer(cfg.train)
  mesh = parallel.make_mesh(1, 1, jax.devices()[:1])
  sh = training.state_shardings_for(m, tx, mesh)
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
  try:
    state, data, meta = ckpt.restore(
        abstract_state=training.abstract_state(m, tx, sh),
        expected_fingerprint=training.fingerprint(m))
  finally:
    ckpt.close()
  return cfg, m, state, data, meta


def logits_of(model_cfg, params, toks):
  gdef = training.graphdef(model_cfg)
  fwd = jax.jit(lambda p, t: nnx.merge(gdef, p)(t))
  return np.asarray(fwd(params, jnp.asarray(toks)))


def random_tokens(vocab, b=2, t=13, seed=0):
  return np.random.RandomState(seed).randint(0, vocab, (b, t)).astype(np.int32)


@pytest.fixture(scope="module")
def prenorm_run(tmp_path_factory):
  """A prenorm workdir trained two steps, and its final parameters."""
  wd = tmp_path_factory.mktemp("prenorm")
  res = make_trainer(prenorm_config(), wd).run()
  return wd, jax.device_get(res["state"]["params"])


# -- this project's prenorm checkpoints --------------------------------------------

def test_prenorm_checkpoint_converts_to_identical_delta(prenorm_run, tmp_path,
                                                        capsys):
  src, params = prenorm_run
  dst = tmp_path / "delta"
  assert convert.main(["--from", str(src), "--to", str(dst),
                       "--routing_heads", "4", "--num_blocks", "2"]) == 0
  out = capsys.readouterr().out
  assert f"--config={dst}/config.py --workdir={dst}" in out
  assert sorted(os.listdir(dst)) == ["checkpoints", "config.py", "convert.json"]
  cfg, m, state, data, meta = restore_converted(dst)
  assert (m.residual, m.routing_heads, m.num_blocks) == ("delta", 4, 2)
  # the fingerprint is what the trainer computes for this config
  assert meta["fingerprint"] == make_trainer(cfg, tmp_path / "x").fingerprint
  assert meta["step"] == 0 and int(state["step"]) == 0
  assert meta["converted_from"]["step"] == 2
  assert data == {"next_index": 0}
  # fresh optimiser state: zero moments and counts
  for leaf in jax.tree.leaves(state["opt_state"]):
    assert not np.any(np.asarray(leaf))
  # delta-only parameters equal a freshly initialised delta model's
  fresh = jax.jit(lambda: nnx.to_pure_dict(nnx.state(
      Transformer(m, rngs=nnx.Rngs(5)), nnx.Param)))()
  got = state["params"]
  for key in ("null_source", "gates", "routers"):
    jax.tree.map(np.testing.assert_array_equal, got[key], fresh[key])
  # the shared parameters are copied exactly
  src_cfg = model_config(prenorm_config())
  for path, v in convert._flat(params).items():
    np.testing.assert_array_equal(convert._flat(got)[path], v)
  toks = random_tokens(m.vocab_size)
  want = logits_of(src_cfg, params, toks)
  have = logits_of(m, got, toks)
  assert np.abs(have - want).max() <= TOL, np.abs(have - want).max()
  assert np.abs(want).max() > 1e-2           # not trivially zero
  # ... and the gates are wired: opening them changes the function
  moved = jax.tree.map(lambda x: x, got)
  moved["gates"] = {k: np.ones_like(v) for k, v in got["gates"].items()}
  moved["null_source"] = np.ones_like(got["null_source"])
  assert np.abs(logits_of(m, moved, toks) - want).max() > 1e-4


def test_converted_workdir_resumes_in_the_trainer(prenorm_run, tmp_path):
  src, _ = prenorm_run
  dst = tmp_path / "delta"
  convert.convert(str(src), str(dst))
  cfg = convert.load_config_file(str(dst / "config.py"))
  cfg.train.update(steps=2, warmup_steps=1)
  res = make_trainer(cfg, dst).run()
  assert res["step"] == 2
  assert [s for s, _ in res["train_history"]] == [1, 2]
  assert all(np.isfinite(l) for _, l in res["train_history"])
  # the run moved the delta parameters off their zero start (the final site
  # reads every block delta; sites of the first block see only the null source)
  gates = res["state"]["params"]["gates"]
  assert np.any(np.asarray(gates[max(gates)]) != 0)
  assert sorted(int(s) for s in os.listdir(dst / "checkpoints")
                if s.isdigit()) == [0, 2]


def test_prenorm_target_restarts_the_same_model_at_step_0(prenorm_run,
                                                         tmp_path):
  """``--residual prenorm``: the control for a delta conversion, same
  parameters and logits, fresh optimiser, step 0, resumable."""
  src, params = prenorm_run
  dst = tmp_path / "plain"
  assert convert.main(["--from", str(src), "--to", str(dst),
                       "--residual", "prenorm"]) == 0
  cfg, m, state, data, meta = restore_converted(dst)
  assert m == model_config(prenorm_config())
  assert meta["step"] == 0 and meta["converted_from"]["residual"] == "prenorm"
  jax.tree.map(np.testing.assert_array_equal, state["params"], params)
  for leaf in jax.tree.leaves(state["opt_state"]):
    assert not np.any(np.asarray(leaf))
  cfg.train.update(steps=1, warmup_steps=1)
  assert make_trainer(cfg, dst).run()["step"] == 1


def test_latest_readable_step_is_used(prenorm_run, tmp_path):
  src, _ = prenorm_run
  wd = tmp_path / "run"
  shutil.copytree(src, wd)
  ck = wd / "checkpoints"
  shutil.copytree(ck / "2", ck / "7")                 # a newer, broken step
  os.remove(ck / "7" / "state" / "_METADATA")
  r = convert.convert(str(ck), str(tmp_path / "out"))  # the checkpoints dir
  assert r["provenance"]["step"] == 2


def test_mhar_mismatch_names_tensor_and_shapes(prenorm_run, tmp_path, capsys):
  src, _ = prenorm_run
  wd = tmp_path / "run"
  shutil.copytree(src, wd)
  meta_path = wd / "checkpoints" / "2" / "meta" / "meta.json"
  meta = json.loads(meta_path.read_text())
  meta["config"]["model"]["ffn_dim"] = 96             # config != arrays
  meta_path.write_text(json.dumps(meta))
  dst = tmp_path / "out"
  assert convert.main(["--from", str(wd), "--to", str(dst)]) == 1
  err = capsys.readouterr().err
  assert "layers/0/mlp/mlp/w_gate: expected shape (32, 96), found (32, 64)" in err
  assert "Traceback" not in err
  assert not dst.exists()
  assert sorted(os.listdir(tmp_path)) == ["run"]     # no temp dir left over
  # a non-prenorm source is refused
  meta["config"]["model"].update(ffn_dim=64, residual="mhar")
  meta_path.write_text(json.dumps(meta))
  with pytest.raises(convert.ConversionError, match="model.residual='mhar'"):
    convert.convert(str(wd), str(dst))


def test_nonempty_destination_is_refused_and_untouched(prenorm_run, tmp_path):
  src, _ = prenorm_run
  dst = tmp_path / "busy"
  dst.mkdir()
  (dst / "keep.txt").write_text("mine")
  with pytest.raises(convert.ConversionError, match="not an empty directory"):
    convert.convert(str(src), str(dst))
  assert os.listdir(dst) == ["keep.txt"]
  empty = tmp_path / "empty"
  empty.mkdir()
  convert.convert(str(src), str(empty))                # an empty one is fine
  assert (empty / "checkpoints" / "0").is_dir()


def test_config_file_must_match_the_source(prenorm_run, tmp_path):
  src, _ = prenorm_run
  path = tmp_path / "other.py"
  path.write_text(
      "from mhar_jax.config import base_config\n"
      "def get_config():\n"
      "  c = base_config()\n"
      "  c.model.update(vocab_size=2048, d_model=32, num_layers=2, num_heads=4,\n"
      "                 num_kv_heads=2, head_dim=8, ffn_dim=64, max_seq_len=64,\n"
      "                 residual='delta', routing_heads=2, num_blocks=4,\n"
      "                 rope_theta=5e5, dtype='float32')\n"
      "  c.train.update(seq_len=64, lr=1e-4)\n"
      "  return c\n")
  with pytest.raises(convert.ConversionError,
                     match=r"model.rope_theta: checkpoint 10000.0, --config 500000.0"):
    convert.convert(str(src), str(tmp_path / "a"), config=str(path))
  path.write_text(path.read_text().replace("rope_theta=5e5", "rope_theta=1e4"))
  r = convert.convert(str(src), str(tmp_path / "b"), config=str(path))
  m = r["model_cfg"]   # architecture from the source, the rest from the file
  assert (m.max_seq_len, m.routing_heads, m.num_blocks) == (64, 2, 4)
  assert r["config"]["train"]["lr"] == 1e-4


def test_delta_target_drops_the_source_major_memory_trades():
  """A baseline trained from a paper preset carries its
  ``recompute_site_outputs=0.5``; the delta form, which has no source-major
  stack, converts without it."""
  c = prenorm_config()
  c.model.recompute_site_outputs = 0.5
  src = dataclasses.asdict(model_config(c))
  cfg, full = convert.target_config(src, c.to_dict(), routing_heads=None,
                                    num_blocks=None, from_file=False,
                                    where="checkpoint")
  assert cfg.residual == "delta" and cfg.recompute_site_outputs == 0
  assert full["model"]["recompute_sources"] == "none"
  cfg, _ = convert.target_config(src, c.to_dict(), routing_heads=None,
                                 num_blocks=None, from_file=False,
                                 where="checkpoint", residual="prenorm")
  assert cfg.recompute_site_outputs == 0.5


# -- Hugging Face checkpoints ----------------------------------------------------

def hf_config_dict(**kw):
  hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "max_position_embeddings": 128,
        "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"},
        "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False}
  hf.update(kw)
  return hf


def write_fake_llama(path, hf, *, break_tensor=None):
  """A Llama-layout safetensors checkpoint from numpy (no torch needed)."""
  from safetensors.numpy import save_file
  cfg = TransformerConfig(**convert.hf_architecture(hf))
  rng = np.random.RandomState(0)
  tensors = {}
  for name, (_, shape, _) in convert.hf_tensor_map(cfg).items():
    if name == break_tensor:
      shape = (shape[0] + 1,) + shape[1:]
    tensors[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
  os.makedirs(path)
  (path / "config.json").write_text(json.dumps(hf))
  save_file(tensors, str(path / "model.safetensors"))


def test_hf_mismatch_names_tensor_and_shapes(tmp_path, capsys):
  pytest.importorskip("safetensors")
  src = tmp_path / "hf"
  bad = "model.layers.1.self_attn.k_proj.weight"
  write_fake_llama(src, hf_config_dict(), break_tensor=bad)
  dst = tmp_path / "out"
  assert convert.main(["--from", str(src), "--to", str(dst)]) == 1
  err = capsys.readouterr().err
  assert (f"{bad} (in model.safetensors): expected shape (16, 32), found"
          " (17, 32)") in err, err
  assert not dst.exists() and sorted(os.listdir(tmp_path)) == ["hf"]
  # a well-formed copy converts (and would be exercised by the trainer)
  good = tmp_path / "good"
  write_fake_llama(good, hf_config_dict())
  r = convert.convert(str(good), str(dst))
  assert r["model_cfg"].qk_norm is False and not r["model_cfg"].tie_embeddings


@pytest.mark.parametrize("change,match", [
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5,
                           "factor": 8.0}),
     r"rope_parameters=.*'llama3' is not implemented"),
    (dict(rope_parameters=None, rope_theta=1e4,
          rope_scaling={"type": "linear", "factor": 2.0}),
     r"rope_scaling=.*'linear' is not implemented"),
    (dict(attention_bias=True), r"attention_bias=True: biases"),
    (dict(model_type="mistral"), r"model_type='mistral'"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu'"),
])
def test_hf_unsupported_architecture_is_rejected(change, match):
  with pytest.raises(convert.ConversionError, match=match):
    convert.hf_architecture(hf_config_dict(**change))


def save_hf(model, path):
  model.save_pretrained(str(path), safe_serialization=True,
                        max_shard_size="20KB")       # sharded, with an index


def perturb_norms(model, torch):
  """HF initialises RMSNorm gains to ones; make them matter."""
  g = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for _, p in model.named_parameters():
      if p.ndim == 1:
        p.add_(0.3 * torch.randn(p.shape, generator=g))


def compare_with_transformers(model, src, dst, torch, vocab):
  r = convert.convert(str(src), str(dst), dtype="float32")
  _, m, state, _, _ = restore_converted(dst)
  toks = random_tokens(vocab, t=17)
  have = logits_of(m, state["params"], toks)
  with torch.no_grad():
    want = model(torch.tensor(toks, dtype=torch.long)).logits.float().numpy()
  err = float(np.abs(have - want).max())
  assert err <= TOL, err
  assert np.abs(want).max() > 0.3               # logits are not trivially small
  return r, m


def test_hf_llama_logits_match_transformers(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  hf = transformers.LlamaConfig(
      vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
      rope_theta=5e5, tie_word_embeddings=False, initializer_range=0.1,
      max_position_embeddings=64)
  model = transformers.LlamaForCausalLM(hf).eval()
  perturb_norms(model, torch)
  save_hf(model, tmp_path / "hf")
  assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
  r, m = compare_with_transformers(model, tmp_path / "hf", tmp_path / "out",
                                   torch, 96)
  assert (m.qk_norm, m.tie_embeddings, m.rope_theta) == (False, False, 5e5)
  assert (m.residual, m.routing_heads, m.num_blocks) == ("delta", 8, 4)
  assert r["provenance"]["model_type"] == "llama"


def test_hf_qwen3_logits_match_transformers(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  if not hasattr(transformers, "Qwen3ForCausalLM"):
    pytest.skip("this transformers has no Qwen3")
  torch.manual_seed(0)
  hf = transformers.Qwen3Config(
      vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
      rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.1,
      max_position_embeddings=64)
  model = transformers.Qwen3ForCausalLM(hf).eval()
  perturb_norms(model, torch)
  save_hf(model, tmp_path / "hf")
  _, m = compare_with_transformers(model, tmp_path / "hf", tmp_path / "out",
                                   torch, 96)
  assert (m.qk_norm, m.tie_embeddings, m.head_dim) == (True, True, 16)


def test_hf_converted_workdir_resumes_in_the_trainer(tmp_path):
  """Untied head, no QK norm, vocabulary of the shipped tiny corpus."""
  pytest.importorskip("safetensors")
  src = tmp_path / "hf"
  write_fake_llama(src, hf_config_dict(vocab_size=2048))
  dst = tmp_path / "out"
  convert.convert(str(src), str(dst))
  cfg = convert.load_config_file(str(dst / "config.py"))
  cfg.train.update(steps=2, warmup_steps=1, global_batch=4, seq_len=32)
  cfg.eval.update(every=1000, batches=1)
  cfg.checkpoint.update(async_save=False)
  res = make_trainer(cfg, dst).run()
  assert res["step"] == 2
  assert all(np.isfinite(l) for _, l in res["train_history"])
  assert "lm_head" in res["state"]["params"]


def test_fresh_data_state_matches_a_fresh_iterator():
  from mhar_jax.data import make_train_iterator, resolve_data_dir
  it = make_train_iterator(resolve_data_dir(""), "train", seq_len=32,
                           global_batch=4, seed=0)
  assert it.get_state() == convert.fresh_data_state(0)


def test_fresh_opt_state_equals_tx_init():
  tx = training.make_optimizer(ml_collections.ConfigDict(
      base_config().train.to_dict()))
  p = {"a": np.full((3, 2), 0.5, np.float32), "b": {"c": np.ones(4, np.float32)}}
  want = jax.device_get(tx.init(p))
  got = convert.fresh_opt_state(tx, p)
  assert jax.tree.structure(want) == jax.tree.structure(got)
  jax.tree.map(np.testing.assert_array_equal, want, got)


def test_processes_flag_writes_a_data_state_per_process(prenorm_run, tmp_path):
  src, _ = prenorm_run
  dst = tmp_path / "out"
  convert.convert(str(src), str(dst), processes=2)
  step = dst / "checkpoints" / "0"
  for i in (0, 1):
    assert json.loads((step / "data" / f"process_{i}.json").read_text()) == {
        "next_index": 0}
  assert json.loads((step / "meta" / "meta.json").read_text())[
      "process_count"] == 2


LLAMA_31_8B = {   # Meta's config.json of Llama-3.1-8B
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0, "tie_word_embeddings": False,
    "vocab_size": 128256,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192,
                     "rope_type": "llama3"}}


def test_8b_delta_preset_matches_the_llama_31_8b_architecture():
  import pathlib
  path = pathlib.Path(__file__).resolve().parents[1] / "configs" / "8b_delta.py"
  with pytest.raises(convert.ConversionError, match="'llama3' is not implemented"):
    convert.hf_architecture(LLAMA_31_8B)
  arch = convert.hf_architecture(dict(LLAMA_31_8B, rope_scaling=None))
  file_cfg = convert._config_json(convert.load_config_file(str(path)))
  cfg, full = convert.target_config(
      {k: arch[k] for k in convert.ARCH_KEYS}, file_cfg, routing_heads=None,
      num_blocks=None, from_file=True, where="config.json")
  assert cfg == model_config(convert.load_config_file(str(path)))
  assert (cfg.residual, cfg.routing_heads, cfg.num_blocks) == ("delta", 8, 8)
  assert full["train"]["lr"] == 4e-4 and full["train"]["z_loss"] == 1e-4
