"""The paper's 100m preset (DESIGN.md §2): d 512, 12 blocks, 8/4 heads of 64, FFN 1536, seq 2048, batch 64.

Qwen3-style decoder, vocabulary 151,936 (override with --config.model.vocab_size),
bf16 compute with fp32 parameters, AdamW 5e-4 with 1000 warm-up steps and cosine
to 0.1x over 20K steps. MHAR with 8 heads by default; pick the scheme with
--config.model.residual=prenorm|hyper|attnres|mhar and --config.model.routing_heads.
"""

from mhar_jax.config import base_config


def get_config():
  c = base_config()
  c.model.update(vocab_size=151_936, d_model=512, num_layers=12, num_heads=8,
                 num_kv_heads=4, head_dim=64, ffn_dim=1536, max_seq_len=2048,
                 residual="mhar", routing_heads=8, dtype="bfloat16")
  c.train.update(steps=20_000, global_batch=64, seq_len=2048, lr=5e-4,
                 warmup_steps=1000, final_lr_ratio=0.1)
  return c
