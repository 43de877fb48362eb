"""The paper's 100m preset (DESIGN.md §2): d 512, 12 blocks, 8/4 heads of 64, FFN 1536, seq 2048, batch 64.

Qwen3-style decoder, vocabulary 151,936 (override with --config.model.vocab_size),
bf16 compute with fp32 parameters, AdamW 5e-4 with 1000 warm-up steps and cosine
to 0.1x over 20K steps. MHAR with 8 heads by default; pick the scheme with
--config.model.residual=prenorm|hyper|attnres|mhar and --config.model.routing_heads.
"""

from mhar_jax.config import paper_preset


def get_config():
  return paper_preset(d_model=512, num_layers=12, num_heads=8, num_kv_heads=4,
                      head_dim=64, ffn_dim=1536, seq_len=2048, global_batch=64)
