"""The tiny offline corpus shipped in ``mhar_jax/data/assets/``.

``ensure_tiny_dataset()`` tokenizes it (once, cached) into a dataset directory
with splits ``train`` and ``val``, usable as ``data.data_dir`` for the tiny
training config. Corpus: Python language-reference prose + standard-library
source (~760 KB train, ~54 KB val; see ``build_tiny_assets``), tokenizer: a
2,048-entry byte-level BPE with ``<|endoftext|>`` = 0.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

from mhar_jax.data.prepare import META_FILE, prepare_split

ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
TINY_TOKENIZER = os.path.join(ASSETS_DIR, "tiny_tokenizer.json")
TINY_SPLITS = {"train": "tiny_train.txt.xz", "val": "tiny_val.txt.xz"}


def _assets_digest() -> str:
    h = hashlib.sha256()
    for name in ["tiny_tokenizer.json", *TINY_SPLITS.values()]:
        with open(os.path.join(ASSETS_DIR, name), "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:12]


def default_cache_dir() -> str:
    """``$MHAR_JAX_CACHE``, else ``$XDG_CACHE_HOME/mhar_jax``, else ``~/.cache/mhar_jax``."""
    if os.environ.get("MHAR_JAX_CACHE"):
        return os.environ["MHAR_JAX_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mhar_jax")


def ensure_tiny_dataset(cache_dir: str | None = None) -> str:
    """Returns a prepared data dir (splits ``train``, ``val``) for the tiny corpus.

    Built on first use into ``cache_dir/tiny-<assets hash>`` (``cache_dir``
    defaults to ``default_cache_dir()``) with the same code as
    ``python -m mhar_jax.data.prepare``; later calls return the cached copy.
    Safe when several processes call it at once (build in a temp dir, then an
    atomic rename). Deterministic: same assets give byte-identical shards.
    """
    cache_dir = os.path.abspath(cache_dir or default_cache_dir())
    out = os.path.join(cache_dir, f"tiny-{_assets_digest()}")
    if all(os.path.isfile(os.path.join(out, s, META_FILE)) for s in TINY_SPLITS):
        return out
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-build-", dir=cache_dir)
    try:
        for split, name in TINY_SPLITS.items():
            prepare_split([os.path.join(ASSETS_DIR, name)], TINY_TOKENIZER, tmp, split,
                          workers=0, progress=False)
        try:
            os.rename(tmp, out)
        except OSError:  # another process won the race (or a stale partial dir)
            if not all(os.path.isfile(os.path.join(out, s, META_FILE)) for s in TINY_SPLITS):
                shutil.rmtree(out, ignore_errors=True)
                os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_data_dir(data_dir: str, cache_dir: str | None = None) -> str:
    """``data_dir``, or the tiny dataset (``ensure_tiny_dataset``) when it is ``""``."""
    return data_dir if data_dir else ensure_tiny_dataset(cache_dir)
