"""Data pipeline: tokenize text into token shards (``prepare``), load packed,
shuffled, process-sharded batches with grain (``loader``), and the shipped tiny
corpus (``tiny``).

Names are imported lazily, so ``python -m mhar_jax.data.prepare`` (and its
worker processes) do not pay for importing grain.
"""

import importlib

_EXPORTS = {
    "loader": ("TokenStream", "available_splits", "bits_per_byte", "bytes_per_token",
               "check_data_dir", "load_meta", "make_eval_batches", "make_train_dataset",
               "make_train_iterator", "num_eval_batches", "state_from_bytes", "state_to_bytes"),
    "prepare": ("EOT_TOKEN", "prepare_split"),
    "tiny": ("TINY_TOKENIZER", "default_cache_dir", "ensure_tiny_dataset", "resolve_data_dir"),
    "tokenizer_info": ("tokenizer_eot_id", "tokenizer_vocab_size"),
}
_WHERE = {name: mod for mod, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
