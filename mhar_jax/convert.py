"""Convert a trained model into the ``delta`` scheme, ready to mid-train.

    python -m mhar_jax.convert --from SRC --to DST [--format auto|mhar|hf]
        [--routing_heads 8] [--num_blocks 8] [--config configs/8b_delta.py]
        [--processes 1]

Sources (``--format auto`` tells them apart by ``config.json``):

``mhar``
    a ``prenorm`` run of this project: a trainer workdir or its
    ``checkpoints`` directory. The newest step that reads back is used
    (unreadable newer steps are skipped with a warning); its meta's config
    gives the architecture.
``hf``
    a Hugging Face ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` directory:
    ``config.json`` and ``*.safetensors`` (one file or sharded with
    ``model.safetensors.index.json``).

The output is a trainer workdir at step 0: ``DST/checkpoints/0`` (parameters,
a fresh AdamW state, data-iterator state at the start, meta whose fingerprint
is what :class:`mhar_jax.train.Trainer` computes for the delta config) and
``DST/config.py``, the full training config. Resume (mid-train) with::

    python -m mhar_jax.train --config=DST/config.py --workdir=DST

The delta model is the source model plus a gated, routed correction (DESIGN.md
§1) whose gates, queries and null source start at zero, so at step 0 it
computes exactly the source's function (tests/test_convert.py checks logits
to 1e-5 in float32 against this project's prenorm model and against
``transformers``). The schedule restarts at step 0, so ``train.warmup_steps``
is a re-warm-up.

Nothing is written to DST until the conversion has succeeded: the workdir is
built in a temporary directory next to DST and renamed at the end; a
non-empty DST is refused. Shape or architecture mismatches raise
:class:`ConversionError` naming the tensor (or key) and the expected and found
values.

Host memory: the parameters in ``param_dtype`` (float32: 4 bytes per
parameter, 32 GB for 8B) plus one source tensor at a time; the optimiser
moments are written from zero pages and cost no resident memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import logging
import os
import pprint
import shutil
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

logger = logging.getLogger(__name__)

# Fields that define the function a checkpoint computes (compared between the
# source and a --config file); the rest (max_seq_len, dtypes, init_std, the
# implementation choices) are taken from the target config.
ARCH_KEYS = ("vocab_size", "d_model", "num_layers", "num_heads",
             "num_kv_heads", "head_dim", "ffn_dim", "rope_theta", "norm_eps",
             "qk_norm", "tie_embeddings")
# Parameters that only the delta scheme has, and their initial values.
DELTA_ONLY = {"null_source": 0.0, "gates": 0.0, "query": 0.0,
              "norm_scale": 1.0}

HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


class ConversionError(ValueError):
  """The source cannot be converted (names the tensor or key and the values)."""


# -- small helpers -------------------------------------------------------------

def _flat(tree, prefix=()) -> dict[str, Any]:
  """Nested dict -> ``{"layers/0/attention/attn/wq": leaf}`` (keys as str)."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flat(v, prefix + (str(k),)))
    else:
      out["/".join(prefix + (str(k),))] = v
  return out


def _unflat_like(template, flat: dict[str, Any], prefix=()):
  """``template``'s nested structure (its own key types) with leaves from ``flat``."""
  return {k: (_unflat_like(v, flat, prefix + (str(k),)) if isinstance(v, dict)
              else flat["/".join(prefix + (str(k),))])
          for k, v in template.items()}


def _shape(x) -> tuple[int, ...]:
  return tuple(int(d) for d in x.shape)


def expected_params(model_cfg) -> dict[str, Any]:
  """Flat ``{path: ShapeDtypeStruct}`` of a model's parameters (no allocation)."""
  from flax import nnx
  from mhar_jax import training
  return _flat(nnx.to_pure_dict(training.abstract_params(model_cfg)))


def _is_delta_only(path: str) -> float | None:
  """Initial value of a delta-only parameter, None for a shared one."""
  parts = path.split("/")
  if parts[0] == "null_source":
    return DELTA_ONLY["null_source"]
  if parts[0] == "gates":
    return DELTA_ONLY["gates"]
  if parts[0] == "routers":
    return DELTA_ONLY[parts[-1]]
  return None


def load_config_file(path: str):
  """``get_config()`` of a config file (like ``--config`` of the trainer)."""
  if not os.path.isfile(path):
    raise ConversionError(f"--config={path!r}: no such file.")
  from mhar_jax import config
  return config.load_config_file(path)


def _config_json(cfg) -> dict:
  return json.loads(cfg.to_json_best_effort())


# -- source: a checkpoint of this project ---------------------------------------

def checkpoints_dir(path: str) -> str:
  """``path/checkpoints`` for a trainer workdir, ``path`` for a checkpoints dir."""
  sub = os.path.join(path, "checkpoints")
  if os.path.isdir(sub):
    return sub
  if os.path.isdir(path) and any(n.isdigit() for n in os.listdir(path)):
    return path
  raise ConversionError(
      f"--from={path!r}: neither a trainer workdir (no checkpoints/"
      " directory) nor a checkpoints directory (no numbered step directories),"
      " nor a Hugging Face directory (no config.json).")


def _restore_params(step_dir: str, found: dict[str, Any]) -> dict[str, np.ndarray]:
  """Reads only ``params`` of a saved training state as numpy arrays."""
  import jax
  from mhar_jax.checkpoint import read_params
  try:
    device = jax.devices("cpu")[0]
  except RuntimeError:      # JAX_PLATFORMS names only an accelerator
    device = jax.local_devices()[0]
  cpu = jax.sharding.SingleDeviceSharding(device)
  abstract = {}
  for path, m in found.items():
    node = abstract
    *parents, leaf = path.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=cpu)
  return {k: np.asarray(v) for k, v in _flat(read_params(step_dir,
                                                          abstract)).items()}


def read_mhar(path: str):
  """``(model_cfg, config dict, flat params, step)`` of the newest readable
  step of a prenorm run."""
  import orbax.checkpoint as ocp
  from mhar_jax.checkpoint import step_problem
  from mhar_jax.layers import TransformerConfig
  ckpt = checkpoints_dir(path)
  steps = sorted((int(n) for n in os.listdir(ckpt)
                  if n.isdigit() and os.path.isdir(os.path.join(ckpt, n))),
                 reverse=True)
  if not steps:
    raise ConversionError(f"--from={path!r}: no checkpoint steps in {ckpt!r}.")
  skipped = []
  for step in steps:
    d = os.path.join(ckpt, str(step))
    problem = step_problem(d)
    if problem:
      skipped.append(f"step {step}: {problem}")
      continue
    try:
      with open(os.path.join(d, "meta", "meta.json")) as f:
        meta = json.load(f)
      config = meta["config"]
      model = dict(config["model"])
    except (OSError, ValueError, KeyError, TypeError) as e:
      skipped.append(f"step {step}: unreadable meta ({type(e).__name__}: {e})")
      continue
    try:
      src_cfg = TransformerConfig.from_dict(model)
    except ValueError as e:
      raise ConversionError(f"{d}: the checkpoint's model config is not valid"
                            f" here: {e}") from e
    if src_cfg.residual != "prenorm":
      raise ConversionError(
          f"{d}: model.residual={src_cfg.residual!r}; only a 'prenorm'"
          " checkpoint can be converted to the delta scheme (identity at"
          " step 0).")
    try:
      with ocp.PyTreeCheckpointer() as ckptr:
        tree = ckptr.metadata(os.path.join(d, "state")).item_metadata.tree
      found = _flat(tree["params"])
    except Exception as e:  # noqa: BLE001 - any failure: unreadable step
      skipped.append(f"step {step}: unreadable state metadata"
                     f" ({type(e).__name__}: {e})")
      continue
    _check_tree(expected_params(src_cfg), found,
                where=f"{d}/state params (model config of its meta.json)")
    try:
      params = _restore_params(d, found)
    except Exception as e:  # noqa: BLE001
      skipped.append(f"step {step}: unreadable state ({type(e).__name__}: {e})")
      continue
    for s in skipped:
      logger.warning("skipped %s", s)
      print(f"mhar_jax.convert: warning: skipped {s}", file=sys.stderr)
    return src_cfg, config, params, step
  raise ConversionError(f"--from={path!r}: no readable checkpoint in {ckpt!r}: "
                        + "; ".join(skipped))


def _check_tree(expected: dict[str, Any], found: dict[str, Any], where: str):
  problems = []
  for k in sorted(set(expected) | set(found)):
    if k not in found:
      problems.append(f"{k}: expected shape {_shape(expected[k])}, missing")
    elif k not in expected:
      problems.append(f"{k}: not expected, found shape {_shape(found[k])}")
    elif _shape(expected[k]) != _shape(found[k]):
      problems.append(f"{k}: expected shape {_shape(expected[k])}, found"
                      f" {_shape(found[k])}")
  if problems:
    raise ConversionError(f"{where}: " + "; ".join(problems))


# -- source: Hugging Face Llama / Qwen3 ------------------------------------------

def hf_architecture(hf: dict, where: str = "config.json") -> dict[str, Any]:
  """TransformerConfig fields of a HF Llama / Qwen3 ``config.json``.

  Raises ConversionError for what this decoder does not implement.
  """
  def bad(key, why):
    raise ConversionError(f"{where}: {key}={hf.get(key)!r}: {why}")

  mt = hf.get("model_type")
  if mt not in HF_ARCHITECTURES:
    bad("model_type", f"only {sorted(HF_ARCHITECTURES)} (architectures"
        f" {sorted(HF_ARCHITECTURES.values())}) can be converted.")
  archs = hf.get("architectures") or [HF_ARCHITECTURES[mt]]
  if HF_ARCHITECTURES[mt] not in archs:
    bad("architectures", f"expected {HF_ARCHITECTURES[mt]!r} (a causal LM with"
        " its LM head).")
  if hf.get("hidden_act", "silu") != "silu":
    bad("hidden_act", "only 'silu' (SwiGLU) is implemented.")
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      bad(key, "biases in the projections are not implemented (this decoder"
          " has bias-free linear layers).")
  if hf.get("use_sliding_window"):
    bad("use_sliding_window", "sliding-window attention is not implemented.")
  types = hf.get("layer_types")
  if types and any(t != "full_attention" for t in types):
    bad("layer_types", "only 'full_attention' layers are implemented.")
  rope = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or {}
  rope_type = (rope.get("rope_type") or rope.get("type")
               or scaling.get("rope_type") or scaling.get("type") or "default")
  if rope_type != "default":
    key = "rope_parameters" if rope.get("rope_type", rope.get("type")) \
        else "rope_scaling"
    bad(key, f"RoPE scaling type {rope_type!r} is not implemented (only plain"
        " RoPE, rope_type 'default'): converting would change the model's"
        " function.")
  theta = rope.get("rope_theta", hf.get("rope_theta"))
  if theta is None:
    bad("rope_theta", "missing (neither rope_parameters.rope_theta nor"
        " rope_theta is set).")
  if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor",
                                              1.0)) != 1.0:
    bad("partial_rotary_factor", "only full rotary embeddings are implemented.")
  heads = int(hf["num_attention_heads"])
  d = int(hf["hidden_size"])
  head_dim = hf.get("head_dim") or d // heads
  tie = hf.get("tie_word_embeddings", False)
  return dict(vocab_size=int(hf["vocab_size"]), d_model=d,
              num_layers=int(hf["num_hidden_layers"]), num_heads=heads,
              num_kv_heads=int(hf.get("num_key_value_heads") or heads),
              head_dim=int(head_dim), ffn_dim=int(hf["intermediate_size"]),
              max_seq_len=int(hf.get("max_position_embeddings", 2048)),
              rope_theta=float(theta), norm_eps=float(hf["rms_norm_eps"]),
              qk_norm=mt == "qwen3", tie_embeddings=bool(tie))


def hf_tensor_map(cfg) -> dict[str, tuple[str, tuple[int, ...], Callable]]:
  """``{hf name: (our param path, expected HF shape, HF array -> ours)}``.

  HF ``nn.Linear`` weights are ``[out, in]``; ours are ``[in, ...]``: q/k/v
  ``[D, H, hd]``, o ``[H, hd, D]``, gate/up ``[D, F]``, down ``[F, D]``.
  """
  d, hq, hkv, hd, f = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads,
                       cfg.head_dim, cfg.ffn_dim)
  ident = lambda w: w  # noqa: E731
  heads_in = lambda h: lambda w: w.T.reshape(d, h, hd)  # noqa: E731
  out = {"model.embed_tokens.weight": ("embedding", (cfg.vocab_size, d), ident),
         "model.norm.weight": ("final_norm/scale", (d,), ident)}
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = ("lm_head", (cfg.vocab_size, d), ident)
  for i in range(cfg.num_layers):
    hf, us = f"model.layers.{i}.", f"layers/{i}/"
    out.update({
        hf + "input_layernorm.weight": (us + "attention/norm/scale", (d,), ident),
        hf + "self_attn.q_proj.weight": (us + "attention/attn/wq", (hq * hd, d),
                                         heads_in(hq)),
        hf + "self_attn.k_proj.weight": (us + "attention/attn/wk", (hkv * hd, d),
                                         heads_in(hkv)),
        hf + "self_attn.v_proj.weight": (us + "attention/attn/wv", (hkv * hd, d),
                                         heads_in(hkv)),
        hf + "self_attn.o_proj.weight": (us + "attention/attn/wo", (d, hq * hd),
                                         lambda w: w.T.reshape(hq, hd, d)),
        hf + "post_attention_layernorm.weight": (us + "mlp/norm/scale", (d,),
                                                 ident),
        hf + "mlp.gate_proj.weight": (us + "mlp/mlp/w_gate", (f, d), np.transpose),
        hf + "mlp.up_proj.weight": (us + "mlp/mlp/w_up", (f, d), np.transpose),
        hf + "mlp.down_proj.weight": (us + "mlp/mlp/w_down", (d, f), np.transpose),
    })
    if cfg.qk_norm:
      out[hf + "self_attn.q_norm.weight"] = (us + "attention/attn/q_norm/scale",
                                             (hd,), ident)
      out[hf + "self_attn.k_norm.weight"] = (us + "attention/attn/k_norm/scale",
                                             (hd,), ident)
  return out


def _hf_files(path: str) -> dict[str, str]:
  """``{tensor name: safetensors file}`` of a HF directory."""
  from safetensors import safe_open
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    names = {}
    for name, file in weight_map.items():
      p = os.path.join(path, file)
      if not os.path.exists(p):
        raise ConversionError(f"{index}: tensor {name} is in {file}, which does"
                              " not exist.")
      names[name] = p
    return names
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise ConversionError(f"--from={path!r}: no *.safetensors files (only"
                          " safetensors checkpoints are supported).")
  names = {}
  for p in files:
    with safe_open(p, framework="numpy") as f:
      for name in f.keys():
        names[name] = p
  return names


IGNORED_HF = (".rotary_emb.inv_freq",)   # buffers some old exports contain


def read_hf(path: str):
  """``(architecture fields, hf config, flat params as float32 numpy)``."""
  import jax
  try:
    from safetensors import safe_open
  except ImportError as e:
    raise ConversionError("reading Hugging Face checkpoints needs the"
                          " safetensors package: pip install safetensors") from e
  from mhar_jax.layers import TransformerConfig
  cfg_path = os.path.join(path, "config.json")
  with open(cfg_path) as f:
    hf = json.load(f)
  try:
    arch = hf_architecture(hf, cfg_path)
  except KeyError as e:
    raise ConversionError(f"{cfg_path}: missing key {e}.") from e
  try:
    cfg = TransformerConfig(**arch, dtype="float32")
  except ValueError as e:
    raise ConversionError(f"{cfg_path}: {e}") from e
  tmap = hf_tensor_map(cfg)
  files = _hf_files(path)
  names = {n for n in files if not n.endswith(IGNORED_HF)}
  if cfg.tie_embeddings:
    names.discard("lm_head.weight")     # some exports store the tied copy
  problems = [f"{n}: expected shape {tmap[n][1]}, missing"
              for n in sorted(set(tmap) - names)]
  problems += [f"{n}: not expected by a {hf['model_type']} model with this"
               " config.json" for n in sorted(names - set(tmap))]
  by_file: dict[str, list[str]] = {}
  for n in sorted(set(tmap) & names):
    by_file.setdefault(files[n], []).append(n)
  # Every shape first, before any tensor is read.
  for file, ns in by_file.items():
    with safe_open(file, framework="numpy") as f:
      for n in ns:
        found = tuple(f.get_slice(n).get_shape())
        if found != tmap[n][1]:
          problems.append(f"{n} (in {os.path.basename(file)}): expected shape"
                          f" {tmap[n][1]}, found {found}")
  if problems:
    raise ConversionError(f"{path}: the checkpoint does not match its"
                          f" config.json: " + "; ".join(problems))
  params = {}
  cpu = jax.devices("cpu")[0]
  for file, ns in by_file.items():
    # framework="flax" reads bfloat16 (numpy has no bfloat16); on the CPU.
    with jax.default_device(cpu), safe_open(file, framework="flax") as f:
      for n in ns:
        ours, _, fn = tmap[n]
        params[ours] = np.ascontiguousarray(
            fn(np.asarray(f.get_tensor(n)).astype(np.float32)))
  return arch, hf, params


# -- target ----------------------------------------------------------------------

def detect_format(path: str) -> str:
  if not os.path.isdir(path):
    raise ConversionError(f"--from={path!r}: no such directory.")
  return "hf" if os.path.exists(os.path.join(path, "config.json")) else "mhar"


def target_config(src_model: dict, base: dict, *, routing_heads: int | None,
                  num_blocks: int | None, from_file: bool, where: str,
                  residual: str = "delta"):
  """The target model config (``residual``: ``delta``, or ``prenorm`` for a
  plain restart of the same model) and the full config dict to train it with.

  ``src_model``: the source's model fields; ``base``: the full config dict
  whose ``model`` section provides the non-architecture fields (the source
  run's, a ``--config`` file's, or the defaults; for the delta form less
  ``recompute_sources`` / ``recompute_site_outputs``, which trade memory in
  the source-major stack the delta form does not have). With ``from_file``
  the file's architecture must equal the source's.
  """
  from mhar_jax.layers import TransformerConfig
  model = dict(base["model"])
  if from_file:
    diffs = [f"model.{k}: {where} {src_model[k]!r}, --config {model.get(k)!r}"
             for k in ARCH_KEYS if model.get(k) != src_model[k]]
    if diffs:
      raise ConversionError("the --config file describes another"
                            " architecture than the source: " + "; ".join(diffs))
  else:
    model.update(src_model)
  n_sub = 2 * int(model["num_layers"])
  if routing_heads is None:
    routing_heads = model.get("routing_heads", 8) if from_file else 8
  if num_blocks is None:
    num_blocks = (model.get("num_blocks") or min(8, n_sub) if from_file
                  else min(8, n_sub))
  if residual == "delta":
    model.update(residual=residual, routing_heads=int(routing_heads),
                 num_blocks=int(num_blocks), recompute_sources="none",
                 recompute_site_outputs=0.0)
  else:
    model.update(residual=residual)
  try:
    cfg = TransformerConfig.from_dict(model)
  except ValueError as e:
    raise ConversionError(str(e)) from e
  full = dict(base)
  full["model"] = dataclasses.asdict(cfg)
  return cfg, full


def delta_params(cfg, shared: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Flat delta-scheme parameters: ``shared`` plus the zero / one initialised
  delta-only parameters (null source, gates, router queries and gains)."""
  want = expected_params(cfg)
  params, problems = {}, []
  for path, sd in want.items():
    init = _is_delta_only(path)
    if init is not None:
      params[path] = np.full(_shape(sd), init, dtype=sd.dtype)
    elif path not in shared:
      problems.append(f"{path}: expected shape {_shape(sd)}, missing")
    elif _shape(shared[path]) != _shape(sd):
      problems.append(f"{path}: expected shape {_shape(sd)}, found"
                      f" {_shape(shared[path])}")
    else:
      params[path] = np.asarray(shared[path]).astype(sd.dtype, copy=False)
  extra = sorted(p for p in shared if p not in want)
  problems += [f"{p}: not a parameter of the delta model" for p in extra]
  if problems:
    raise ConversionError("parameters do not fit the delta model: "
                          + "; ".join(problems))
  return params


def fresh_opt_state(tx, params_tree):
  """``tx.init(params)`` as numpy zeros (untouched zero pages: no memory).

  Checked on a one-element probe of the same structure that ``tx.init``
  really is all zeros; otherwise falls back to calling it.
  """
  import jax
  probe = jax.tree.map(lambda x: np.ones((1,) * x.ndim, x.dtype), params_tree)
  if all(not np.any(np.asarray(x)) for x in jax.tree.leaves(tx.init(probe))):
    shapes = jax.eval_shape(tx.init, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params_tree))
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
  return jax.device_get(tx.init(params_tree))


def fresh_data_state(worker_count: int) -> dict:
  """The state of a fresh training iterator (``make_train_iterator``) with
  ``data.worker_count`` workers; it does not depend on the data."""
  if worker_count <= 0:
    return {"next_index": 0}
  return {"next_index_in_cycle": 0, "next_index_in_datasets": worker_count,
          "iterators_in_use_indices": list(range(worker_count)),
          "iterators_in_use_states": [{"next_index": 0}] * worker_count,
          "exhausted": [0] * worker_count, "future_states": {}}


CONFIG_PY = '''"""Training config of a model converted to the delta scheme by mhar_jax.convert.

Source: {source} ({fmt}{step}). Converted {when}.
Resume (mid-train from step 0, fresh optimiser, re-warm-up) with:

    python -m mhar_jax.train --config={config_path} --workdir={workdir}

Override any key on the command line as usual, e.g. --config.train.steps=5000.
The model section must stay as it is (the checkpoint's fingerprint).
"""

from mhar_jax.config import base_config

CONFIG = {body}


def get_config():
  c = base_config()
  c.update(CONFIG)
  return c
'''


def write_workdir(tmp: str, cfg, full: dict, params: dict[str, np.ndarray],
                  provenance: dict, *, processes: int, final_dir: str):
  """Writes the trainer workdir (checkpoint at step 0 + config.py) in ``tmp``."""
  import jax
  import ml_collections
  from flax import nnx
  from mhar_jax import training
  from mhar_jax.checkpoint import Checkpointer

  train_cfg = ml_collections.ConfigDict(full["train"])
  tx = training.make_optimizer(train_cfg)
  template = nnx.to_pure_dict(training.abstract_params(cfg))
  params_tree = _unflat_like(template, params)
  seed = int(full["train"].get("seed", 0))
  state = {"params": params_tree,
           "opt_state": fresh_opt_state(tx, params_tree),
           "step": np.zeros((), np.int32),
           "rng": np.asarray(jax.random.key_data(jax.random.key(seed + 1))),
           "skipped": np.zeros((), np.int32),
           "consecutive_skips": np.zeros((), np.int32)}
  worker_count = int(full.get("data", {}).get("worker_count", 0))
  data_state = fresh_data_state(worker_count)
  meta = {"config": full, "fingerprint": training.fingerprint(cfg), "step": 0,
          "tokens_seen": 0, "converted_from": provenance}
  ckpt_dir = os.path.join(tmp, "checkpoints")
  ckpt = Checkpointer(ckpt_dir, max_to_keep=1, async_save=False)
  try:
    ckpt.save(0, state, data_state, meta)
  finally:
    ckpt.close()
  step_dir = os.path.join(ckpt_dir, "0")
  if processes > 1:   # restoring checks the process count and reads its file
    src = os.path.join(step_dir, "data", "process_0.json")
    for i in range(1, processes):
      shutil.copyfile(src, os.path.join(step_dir, "data", f"process_{i}.json"))
    meta_path = os.path.join(step_dir, "meta", "meta.json")
    with open(meta_path) as f:
      m = json.load(f)
    m["process_count"] = processes
    with open(meta_path, "w") as f:
      json.dump(m, f)
  config_path = os.path.join(final_dir, "config.py")
  with open(os.path.join(tmp, "config.py"), "w") as f:
    f.write(CONFIG_PY.format(
        source=provenance["source"], fmt=provenance["format"],
        step=(f", step {provenance['step']}" if "step" in provenance else ""),
        when=provenance["converted_at"], config_path=config_path,
        workdir=final_dir,
        body=pprint.pformat(full, indent=1, width=80, sort_dicts=False)))
  with open(os.path.join(tmp, "convert.json"), "w") as f:
    json.dump(provenance, f, indent=2)


def convert(src: str, dst: str, *, fmt: str = "auto",
            routing_heads: int | None = None, num_blocks: int | None = None,
            config: str | None = None, processes: int = 1,
            dtype: str | None = None, residual: str = "delta") -> dict:
  """Converts ``src`` into a delta-scheme trainer workdir ``dst``.

  ``residual="prenorm"`` writes the source model unchanged into the same kind
  of step-0 workdir (fresh optimiser, schedule from step 0): the plain
  continued-training control for a delta conversion.

  Returns a summary dict (``model_cfg``, ``config_path``, ``command``, ...).
  Raises ConversionError; ``dst`` is untouched unless it succeeds.
  """
  from mhar_jax.config import base_config
  if fmt not in ("auto", "mhar", "hf"):
    raise ConversionError(f"--format={fmt!r}: choose auto, mhar or hf.")
  if processes < 1:
    raise ConversionError(f"--processes={processes}: must be >= 1.")
  if residual not in ("delta", "prenorm"):
    raise ConversionError(f"--residual={residual!r}: choose delta or prenorm.")
  dst = os.path.abspath(dst)
  if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
    raise ConversionError(f"--to={dst!r} exists and is not an empty directory;"
                          " refusing to overwrite it.")
  src = os.path.abspath(src)
  fmt = detect_format(src) if fmt == "auto" else fmt
  file_cfg = load_config_file(config) if config else None
  provenance = {"source": src, "format": fmt,
                "converted_at": time.strftime("%Y-%m-%d %H:%M:%S %Z")}

  if fmt == "mhar":
    src_cfg, src_config, shared, step = read_mhar(src)
    provenance["step"] = step
    src_model = {k: getattr(src_cfg, k) for k in ARCH_KEYS}
    base = (_config_json(file_cfg) if file_cfg is not None else src_config)
    if file_cfg is None:
      base = dict(base, model=dataclasses.asdict(src_cfg))
    where = "checkpoint"
  else:
    if not os.path.exists(os.path.join(src, "config.json")):
      raise ConversionError(f"--from={src!r}: no config.json (--format=hf).")
    arch, hf, shared = read_hf(src)
    provenance["model_type"] = hf["model_type"]
    src_model = {k: arch[k] for k in ARCH_KEYS}
    if file_cfg is not None:
      base = _config_json(file_cfg)
    else:
      c = base_config()
      c.model.update(arch)
      c.train.seq_len = min(c.train.seq_len, arch["max_seq_len"])
      base = _config_json(c)
    where = "config.json"
  if dtype is not None:
    base = dict(base, model=dict(base["model"], dtype=dtype))
  cfg, full = target_config(src_model, base, routing_heads=routing_heads,
                            num_blocks=num_blocks,
                            from_file=file_cfg is not None, where=where,
                            residual=residual)
  params = delta_params(cfg, shared)
  del shared
  provenance.update(residual=residual, routing_heads=cfg.routing_heads,
                    num_blocks=cfg.num_blocks)

  parent = os.path.dirname(dst)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.convert-",
                         dir=parent)
  try:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)     # mkdtemp makes it private (0700)
    write_workdir(tmp, cfg, full, params, provenance, processes=processes,
                  final_dir=dst)
    if os.path.exists(dst):
      if os.listdir(dst):
        raise ConversionError(f"--to={dst!r} became non-empty during the"
                              " conversion; left it alone.")
      os.rmdir(dst)
    os.rename(tmp, dst)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  n = sum(int(p.size) for p in params.values())
  n_delta = sum(int(p.size) for k, p in params.items()
                if _is_delta_only(k) is not None)
  config_path = os.path.join(dst, "config.py")
  return {"model_cfg": cfg, "config": full, "workdir": dst,
          "config_path": config_path, "format": fmt, "params": n,
          "delta_params": n_delta, "provenance": provenance,
          "command": ("python -m mhar_jax.train"
                      f" --config={config_path} --workdir={dst}")}


def describe(cfg) -> str:
  if cfg.residual == "delta":
    return (f"delta: routing heads {cfg.routing_heads}, {cfg.num_blocks}"
            " blocks")
  return cfg.residual


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
      prog="python -m mhar_jax.convert",
      description="Convert a prenorm checkpoint of this project or a Hugging"
      " Face Llama / Qwen3 checkpoint into a delta-scheme trainer workdir at"
      " step 0 (identical function, fresh optimiser).")
  p.add_argument("--from", dest="src", required=True,
                 help="trainer workdir / checkpoints dir, or HF directory")
  p.add_argument("--to", dest="dst", required=True,
                 help="new trainer workdir (must not exist or be empty)")
  p.add_argument("--format", default="auto", choices=("auto", "mhar", "hf"))
  p.add_argument("--routing_heads", type=int, default=None,
                 help="routing heads H (default 8, or the --config file's)")
  p.add_argument("--num_blocks", type=int, default=None,
                 help="delta blocks (default min(8, 2L), or the --config"
                 " file's)")
  p.add_argument("--config", default=None,
                 help="training config file for the converted model (e.g."
                 " configs/8b_delta.py); its architecture must match the"
                 " source. Default: the source run's config (mhar) or the"
                 " defaults with the HF architecture (hf).")
  p.add_argument("--dtype", default=None,
                 help="override model.dtype (compute dtype) of the output")
  p.add_argument("--processes", type=int, default=1,
                 help="number of processes that will resume the run")
  p.add_argument("--residual", default="delta", choices=("delta", "prenorm"),
                 help="target scheme: delta (default), or prenorm to restart"
                 " the unchanged model at step 0 (the plain continued-training"
                 " control)")
  a = p.parse_args(argv)
  logging.getLogger("absl").setLevel(logging.ERROR)
  try:
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.ERROR)
  except ImportError:  # pragma: no cover
    pass
  t0 = time.time()
  try:
    r = convert(a.src, a.dst, fmt=a.format, routing_heads=a.routing_heads,
                num_blocks=a.num_blocks, config=a.config,
                processes=a.processes, dtype=a.dtype, residual=a.residual)
  except ConversionError as e:
    print(f"mhar_jax.convert: {e}", file=sys.stderr)
    return 1
  cfg = r["model_cfg"]
  src = r["provenance"]
  what = (f"prenorm checkpoint step {src['step']}" if r["format"] == "mhar"
          else f"Hugging Face {src['model_type']} checkpoint")
  print(f"converted {what} {src['source']}\n"
        f"       -> {r['workdir']} ({describe(cfg)}; {r['params']:,}"
        f" parameters of which {r['delta_params']:,} delta-only; step 0) in"
        f" {time.time() - t0:.1f} s\n"
        f"resume with:\n  {r['command']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
