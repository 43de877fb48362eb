"""Data pipeline: tokenize text into token shards (``prepare``), load packed,
shuffled, process-sharded batches with grain (``loader``), and the shipped tiny
corpus (``tiny``)."""

from mhar_jax.data.loader import (
    TokenStream,
    available_splits,
    bits_per_byte,
    bytes_per_token,
    check_data_dir,
    load_meta,
    make_eval_batches,
    make_train_dataset,
    make_train_iterator,
    num_eval_batches,
    state_from_bytes,
    state_to_bytes,
    tokenizer_vocab_size,
)
from mhar_jax.data.prepare import EOT_TOKEN, prepare_split
from mhar_jax.data.tiny import TINY_TOKENIZER, default_cache_dir, ensure_tiny_dataset

__all__ = [
    "EOT_TOKEN", "TINY_TOKENIZER", "TokenStream", "available_splits", "bits_per_byte",
    "bytes_per_token", "check_data_dir", "default_cache_dir", "ensure_tiny_dataset", "load_meta",
    "make_eval_batches", "make_train_dataset", "make_train_iterator", "num_eval_batches",
    "prepare_split", "state_from_bytes", "state_to_bytes", "tokenizer_vocab_size",
]
