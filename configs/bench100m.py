"""The 100m architecture on the benchmark corpus, the paper's recipe scaled to a short run.

Model: the paper's 100m decoder (d 512, 12 blocks, 8/4 heads of 64, FFN 1536,
Qwen3-style, tied embeddings, bf16) with the corpus tokenizer's vocabulary of
16,384. Recipe: AdamW (0.9, 0.95, eps 1e-8, weight decay 0.1), clip 1.0, peak
lr 5e-4, warm-up 5% of the steps (the paper's 1000 of 20K), cosine to 0.1x.
Batch 32 x 2048 tokens; 448 steps = 29.4M tokens by default (change
train.steps; warm-up follows at 5%).

Data: prepare the corpus once (``data/`` is ignored by git)::

    for s in train val val_prose val_code; do
      python -m mhar_jax.data.prepare --input ../shared/data/benchcorpus/$s.txt.xz \\
        --tokenizer ../shared/data/benchcorpus/tokenizer.json \\
        --output data/benchcorpus --split $s
    done

Evaluation: loss and bits per byte on val, val_prose and val_code (all of each,
up to 16 batches of 32 x 2048), at the middle and the end.
"""

from mhar_jax.config import base_config

STEPS = 448   # 29.4M tokens


def get_config():
  c = base_config()
  c.model.update(vocab_size=16_384, d_model=512, num_layers=12, num_heads=8,
                 num_kv_heads=4, head_dim=64, ffn_dim=1536, max_seq_len=2048,
                 residual="mhar", routing_heads=8, dtype="bfloat16")
  c.data.update(data_dir="data/benchcorpus",
                val_splits=("val", "val_prose", "val_code"))
  c.train.update(steps=STEPS, global_batch=32, seq_len=2048, lr=5e-4,
                 final_lr_ratio=0.1)
  # Follow train.steps when it is overridden on the command line.
  steps = c.train.get_ref("steps")
  c.train.warmup_steps = steps // 20
  c.eval.update(every=steps // 2, batches=16)
  c.checkpoint.update(every=steps, keep=1)
  c.log.update(every=16, routing_every=steps // 2)
  return c
