"""Llama-3.1-8B architecture in the delta scheme: mid-training a converted model.

d 4096, 32 blocks, 32 query / 8 KV heads of 128, SwiGLU FFN 14336, vocabulary
128,256, RoPE theta 500,000 (plain RoPE), RMSNorm eps 1e-5, no QK-norm,
untied LM head; delta residual (DESIGN.md §1) with 8 routing heads over 8
blocks. Sequence length 4096.

The paper's mid-training recipe: peak lr 4e-4 reached again after a 1000-step
re-warm-up (the converter starts the run at step 0 with a fresh AdamW state),
weight decay 0.05, z-loss 1e-4, cosine to 0.1x. 10,000 steps of 256 x 4096
tokens = 10.5B tokens (the paper mid-trains ~10B), each step as 128
micro-batches of 2 sequences (grad_accum; the dry run's CPU memory estimate,
which ignores remat, is then ~101 GiB per device: see docs/convert.md; on GPU
a smaller grad_accum may fit).

Start from a converted checkpoint (docs/convert.md)::

    python -m mhar_jax.convert --from /path/to/Llama-3.1-8B-architecture-hf \
        --to workdirs/8b_delta --config configs/8b_delta.py
    python -m mhar_jax.train --config=configs/8b_delta.py \
        --workdir=workdirs/8b_delta --config.data.data_dir=/path/to/tokens

The data must be tokenised with the source model's tokenizer
(--config.data.tokenizer checks its size against model.vocab_size).
Mesh: 8 GPUs as data=1 x model=8 (tensor parallel over heads / MLP /
vocabulary; the 8 routing heads stay one per shard); --config.mesh.data=2
--config.mesh.model=4 also validates.
"""

from mhar_jax.config import base_config


def get_config():
  c = base_config()
  c.model.update(vocab_size=128_256, d_model=4096, num_layers=32, num_heads=32,
                 num_kv_heads=8, head_dim=128, ffn_dim=14_336, max_seq_len=4096,
                 rope_theta=500_000.0, norm_eps=1e-5, qk_norm=False,
                 tie_embeddings=False, residual="delta", routing_heads=8,
                 num_blocks=8, dtype="bfloat16", param_dtype="float32",
                 remat=True)
  c.train.update(steps=10_000, global_batch=256, seq_len=4096, grad_accum=128,
                 lr=4e-4, warmup_steps=1000, final_lr_ratio=0.1,
                 weight_decay=0.05, z_loss=1e-4)
  c.mesh.update(data=1, model=8)
  c.eval.update(every=500, batches=16, batch=16)
  c.checkpoint.update(every=500, keep=3)
  c.log.update(every=10, routing_every=500)
  return c
