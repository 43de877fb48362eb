"""Tiny MHAR model on the shipped corpus: trains on a laptop CPU in about a minute."""

from mhar_jax.config import base_config


def get_config():
  c = base_config()
  c.model.update(vocab_size=2048, d_model=128, num_layers=4, num_heads=4,
                 num_kv_heads=2, head_dim=32, ffn_dim=384, max_seq_len=128,
                 residual="mhar", routing_heads=4, dtype="float32")
  c.train.update(steps=200, global_batch=16, seq_len=128, lr=3e-3,
                 warmup_steps=20, weight_decay=0.1)
  c.eval.update(every=100, batches=4)
  c.checkpoint.update(every=100, keep=2)
  c.log.update(every=20, routing_every=100)
  return c
