"""The paper's 1b preset (DESIGN.md §2): d 1280, 36 blocks, 16/8 heads of 80, FFN 5120, seq 1024, batch 32.

Qwen3-style decoder, vocabulary 151,936 (override with --config.model.vocab_size),
bf16 compute with fp32 parameters, AdamW 5e-4 with 1000 warm-up steps and cosine
to 0.1x over 20K steps. MHAR with 8 heads by default; pick the scheme with
--config.model.residual=prenorm|hyper|attnres|mhar and --config.model.routing_heads.
"""

from mhar_jax.config import paper_preset


def get_config():
  return paper_preset(d_model=1280, num_layers=36, num_heads=16, num_kv_heads=8,
                      head_dim=80, ffn_dim=5120, seq_len=1024, global_batch=32)
