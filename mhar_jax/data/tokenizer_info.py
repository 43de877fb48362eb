"""Light tokenizer queries for start-up checks (imports ``tokenizers`` only)."""

from __future__ import annotations

from mhar_jax.data.prepare import EOT_TOKEN, load_tokenizer, resolve_eot


def tokenizer_vocab_size(path: str) -> int:
    """Vocabulary size (added tokens included) of an HF tokenizers JSON file.

    Raises FileNotFoundError / ValueError naming ``path``. Note: a prepared
    split's ``meta.json["vocab_size"]`` is this + 1 when the tokenizer has no
    end-of-text token (see ``mhar_jax.data.prepare``); prefer the meta value
    when sizing the model for a prepared dataset.
    """
    return load_tokenizer(path).get_vocab_size(with_added_tokens=True)


def tokenizer_eot_id(path: str, eot_token: str = EOT_TOKEN) -> int:
    """The end-of-text id ``prepare`` uses with this tokenizer."""
    return resolve_eot(load_tokenizer(path), eot_token)[0]
