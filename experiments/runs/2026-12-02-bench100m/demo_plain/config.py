"""Training config of a model converted to the delta scheme by mhar_jax.convert.

Source: /work/main/workdirs/compare/prenorm_seed1 (mhar, step 448). Converted 2026-12-02 18:14:05 UTC.
Resume (mid-train from step 0, fresh optimiser, re-warm-up) with:

    python -m mhar_jax.train --config=/work/main/workdirs/compare/demo_plain/config.py --workdir=/work/main/workdirs/compare/demo_plain

Override any key on the command line as usual, e.g. --config.train.steps=5000.
The model section must stay as it is (the checkpoint's fingerprint).
"""

from mhar_jax.config import base_config

CONFIG = {'model': {'vocab_size': 16384,
           'd_model': 512,
           'num_layers': 12,
           'num_heads': 8,
           'num_kv_heads': 4,
           'head_dim': 64,
           'ffn_dim': 1536,
           'max_seq_len': 2048,
           'residual': 'prenorm',
           'routing_heads': 8,
           'num_blocks': 0,
           'hyper_streams': 4,
           'rope_theta': 10000.0,
           'norm_eps': 1e-06,
           'qk_norm': True,
           'tie_embeddings': True,
           'init_std': 0.02,
           'dtype': 'bfloat16',
           'param_dtype': 'float32',
           'attention_impl': None,
           'routing_impl': 'auto',
           'remat': False},
 'data': {'data_dir': 'data/benchcorpus',
          'train_split': 'train',
          'val_splits': ['val', 'val_prose', 'val_code'],
          'tokenizer': '',
          'worker_count': 0},
 'train': {'seed': 1,
           'steps': 448,
           'global_batch': 32,
           'seq_len': 2048,
           'grad_accum': 1,
           'lr': 0.0005,
           'warmup_steps': 22,
           'final_lr_ratio': 0.1,
           'b1': 0.9,
           'b2': 0.95,
           'adam_eps': 1e-08,
           'weight_decay': 0.1,
           'decay': 'matrices',
           'clip_norm': 1.0,
           'z_loss': 0.0,
           'nonfinite': 'stop',
           'max_consecutive_skips': 10},
 'mesh': {'data': -1, 'model': 1},
 'eval': {'every': 224, 'batches': 16, 'batch': 0},
 'checkpoint': {'every': 448, 'keep': 1, 'async_save': True},
 'log': {'every': 16, 'routing_every': 224}}


def get_config():
  c = base_config()
  c.update(CONFIG)
  return c
