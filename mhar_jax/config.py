"""The experiment config: every key, its default, and start-up validation.

Preset files in ``configs/`` start from :func:`base_config` and override. A
config is checked by :func:`validate` before anything is compiled or loaded;
every error names the offending key and value.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

import ml_collections

from mhar_jax.layers import TransformerConfig
from mhar_jax.loss import CHUNK_TOKENS


def base_config() -> ml_collections.ConfigDict:
  """All keys with their defaults (a small CPU-sized model)."""
  c = ml_collections.ConfigDict()
  c.model = ml_collections.ConfigDict(
      dataclasses.asdict(TransformerConfig()))
  c.model.attention_impl = ml_collections.FieldReference(None,
                                                         field_type=str)
  c.model.routing_site_group = ml_collections.FieldReference(None,
                                                             field_type=int)

  c.data = ml_collections.ConfigDict()
  c.data.data_dir = ""            # "" -> the tiny corpus the package ships
  c.data.train_split = "train"
  c.data.val_splits = ("val",)
  c.data.tokenizer = ""           # tokenizer.json, checked against vocab_size
  c.data.worker_count = 0

  c.train = ml_collections.ConfigDict()
  c.train.seed = 0
  c.train.steps = 20_000
  c.train.global_batch = 64
  c.train.seq_len = 2048
  c.train.grad_accum = 1
  c.train.lr = 5e-4
  c.train.warmup_steps = 1000
  c.train.final_lr_ratio = 0.1
  c.train.b1 = 0.9
  c.train.b2 = 0.95
  c.train.adam_eps = 1e-8
  c.train.weight_decay = 0.1
  c.train.decay = "matrices"      # "matrices" (ndim >= 2, no embedding) | "all" | "matrices+embedding"
  c.train.clip_norm = 1.0
  c.train.z_loss = 0.0
  c.train.loss_chunk_tokens = CHUNK_TOKENS  # tokens per device per chunk of the LM head + loss
  c.train.nonfinite = "stop"      # "stop" | "skip"
  c.train.max_consecutive_skips = 10

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1                # -1: all devices not used by other axes
  c.mesh.model = 1

  c.eval = ml_collections.ConfigDict()
  c.eval.every = 500
  c.eval.batches = 16
  c.eval.batch = 0                # 0 -> train.global_batch

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 1000
  c.checkpoint.keep = 3
  c.checkpoint.async_save = True

  c.log = ml_collections.ConfigDict()
  c.log.every = 10
  c.log.routing_every = 500       # routing entropy per site (routed schemes)
  return c


def paper_preset(*, d_model: int, num_layers: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, ffn_dim: int, seq_len: int,
                 global_batch: int) -> ml_collections.ConfigDict:
  """A preset of the paper (DESIGN.md §2): the Qwen3-style decoder at the
  given size with vocabulary 151,936, bf16 compute, MHAR with 8 heads, and the
  recipe (AdamW 5e-4, 1000 warm-up steps, cosine to 0.1x over 20K steps).

  The lowest three quarters of the routing sites recompute their outputs in
  the backward (``model.recompute_site_outputs=0.75``): on an H100 (full 100m
  and 350m, Block 350m) peak memory 1.035-1.044x the baseline's instead of
  ~1.08x (``=0``, every output kept), for 0.8-1.1% of the step more than
  ``=0.5``, which peaks at 1.05-1.06x (benchmarks/RESULTS.md, sessions 29 and
  34)."""
  c = base_config()
  c.model.update(vocab_size=151_936, d_model=d_model, num_layers=num_layers,
                 num_heads=num_heads, num_kv_heads=num_kv_heads,
                 head_dim=head_dim, ffn_dim=ffn_dim, max_seq_len=seq_len,
                 residual="mhar", routing_heads=8, dtype="bfloat16",
                 recompute_site_outputs=0.75)
  c.train.update(steps=20_000, global_batch=global_batch, seq_len=seq_len,
                 lr=5e-4, warmup_steps=1000, final_lr_ratio=0.1)
  return c


def load_config_file(path: str) -> ml_collections.ConfigDict:
  """``get_config()`` of a config file, as ``--config=path`` loads it."""
  spec = importlib.util.spec_from_file_location(
      os.path.splitext(os.path.basename(path))[0], path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def model_config(c: ml_collections.ConfigDict) -> TransformerConfig:
  """The model section as a validated :class:`TransformerConfig`."""
  return TransformerConfig.from_dict(c.model.to_dict())


def mesh_shape(c: ml_collections.ConfigDict, num_devices: int) -> tuple[int, int]:
  """``(data, model)`` with -1 resolved against ``num_devices``."""
  data, model = c.mesh.data, c.mesh.model
  if model < 1:
    raise ValueError(f"mesh.model={model}: must be >= 1.")
  if data == -1:
    if num_devices % model:
      raise ValueError(f"mesh.model={model} does not divide the {num_devices}"
                       " available devices.")
    data = num_devices // model
  if data < 1 or data * model != num_devices:
    raise ValueError(
        f"mesh.data={c.mesh.data}, mesh.model={model}: the mesh has"
        f" {data * model} devices but {num_devices} are available; set"
        " mesh.data=-1 to use them all.")
  return data, model


def validate(c: ml_collections.ConfigDict, *, num_devices: int,
             process_count: int = 1) -> TransformerConfig:
  """Checks every cross-key constraint; returns the model config.

  Raises ValueError naming the key and value of the first problem. Touches
  the filesystem only to check that data and tokenizer files exist.
  """
  m = model_config(c)
  data, model = mesh_shape(c, num_devices)
  t = c.train
  for key in ("steps", "global_batch", "seq_len", "grad_accum",
              "loss_chunk_tokens"):
    if not isinstance(t[key], int) or t[key] < 1:
      raise ValueError(f"train.{key}={t[key]!r}: must be a positive integer.")
  if t.seq_len > m.max_seq_len:
    raise ValueError(f"train.seq_len={t.seq_len} exceeds"
                     f" model.max_seq_len={m.max_seq_len}.")
  if t.global_batch % (data * t.grad_accum):
    raise ValueError(
        f"train.global_batch={t.global_batch} must be divisible by"
        f" mesh data axis ({data}) x train.grad_accum ({t.grad_accum}).")
  if t.global_batch % process_count:
    raise ValueError(f"train.global_batch={t.global_batch} must be divisible"
                     f" by the number of processes ({process_count}).")
  eval_batch = c.eval.batch or t.global_batch
  if eval_batch % data:
    raise ValueError(f"eval.batch={eval_batch} must be divisible by the mesh"
                     f" data axis ({data}).")
  if m.num_heads % model:
    raise ValueError(f"model.num_heads={m.num_heads} must be divisible by"
                     f" mesh.model={model}.")
  if m.num_kv_heads % model:
    raise ValueError(f"model.num_kv_heads={m.num_kv_heads} must be divisible"
                     f" by mesh.model={model}.")
  if m.residual in ("mhar", "delta", "attnres") and m.heads_per_site % model \
      and model > 1:
    raise ValueError(
        f"model.routing_heads={m.heads_per_site} must be divisible by"
        f" mesh.model={model} so each routing head stays on one shard.")
  if not 0 <= t.warmup_steps <= t.steps:
    raise ValueError(f"train.warmup_steps={t.warmup_steps} must be in"
                     f" [0, train.steps={t.steps}].")
  if not (t.lr > 0 and math.isfinite(t.lr)):
    raise ValueError(f"train.lr={t.lr}: must be a positive number.")
  if t.decay not in ("matrices", "all", "matrices+embedding"):
    raise ValueError(f"train.decay={t.decay!r}: choose 'matrices', 'all' or"
                     " 'matrices+embedding'.")
  if t.nonfinite not in ("stop", "skip"):
    raise ValueError(f"train.nonfinite={t.nonfinite!r}: choose 'stop' or"
                     " 'skip'.")
  if c.data.tokenizer:
    if not os.path.exists(c.data.tokenizer):
      raise ValueError(f"data.tokenizer={c.data.tokenizer!r}: no such file.")
    from mhar_jax.data.tokenizer_info import tokenizer_vocab_size
    v = tokenizer_vocab_size(c.data.tokenizer)
    if v > m.vocab_size:
      raise ValueError(
          f"data.tokenizer={c.data.tokenizer!r} has {v} tokens, more than"
          f" model.vocab_size={m.vocab_size}.")
  return m
