"""Tokenize text corpora into flat token shards.

Usage::

    python -m mhar_jax.data.prepare --input train.txt.xz --tokenizer tokenizer.json \\
        --output DIR --split train [--workers 2] [--text_field text]

Inputs are read as a stream, in the order given:

* plain text (``.txt``, or anything not JSONL), optionally ``.xz`` / ``.gz``
  compressed: documents are separated by lines that consist of exactly
  ``<|endoftext|>``. The newline in front of a separator line belongs to the
  separator, so ``"a\\nb\\n<|endoftext|>\\nc\\n"`` holds the documents ``"a\\nb"``
  and ``"c"``.
* JSONL (``.jsonl``, ``.ndjson``, optionally compressed): one JSON object per
  line, the document is the string in ``--text_field``. Blank lines are skipped.

Documents that are empty (or only whitespace) are skipped. Every document is
encoded with the HF ``tokenizers`` JSON tokenizer (no special tokens added) and
followed by one end-of-text id, giving one token stream per split:

    DIR/tokenizer.json                 copy of the tokenizer
    DIR/<split>/shard_00000.bin ...    flat little-endian uint16 (uint32 if vocab > 65536)
    DIR/<split>/meta.json              see ``prepare_split``

The end-of-text id is the id of the tokenizer's ``<|endoftext|>`` token
(``--eot_token``). If the tokenizer has no such token, the first of ``</s>``,
``<eos>``, ``<|eos|>`` it has is used; if it has none of them, the id
``vocab_size`` is used and the split's ``vocab_size`` becomes tokenizer
vocab + 1 (the model's embedding must cover it).

``meta.json`` is written last (atomically), so a split with a ``meta.json`` is
complete.
"""

from __future__ import annotations

import argparse
import bz2
import collections
import concurrent.futures
import gzip
import hashlib
import json
import lzma
import multiprocessing
import os
import shutil
import sys
import time
from typing import Iterable, Iterator, Sequence

import numpy as np

EOT_TOKEN = "<|endoftext|>"
FALLBACK_EOT_TOKENS = ("</s>", "<eos>", "<|eos|>")
META_FILE = "meta.json"
FORMAT_VERSION = 1
_JSONL_SUFFIXES = (".jsonl", ".ndjson")


# ----------------------------------------------------------------------------
# Reading documents


def _open_text(path: str):
    """Opens ``path`` for text reading (UTF-8), decompressing .xz/.gz/.bz2."""
    if path.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8", newline="")
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    if path.endswith(".bz2"):
        return bz2.open(path, "rt", encoding="utf-8", newline="")
    return open(path, "rt", encoding="utf-8", newline="")


def _is_jsonl(path: str) -> bool:
    base = path
    for ext in (".xz", ".gz", ".bz2"):
        if base.endswith(ext):
            base = base[: -len(ext)]
    return base.endswith(_JSONL_SUFFIXES)


def _strip_newline(text: str) -> str:
    if text.endswith("\r\n"):
        return text[:-2]
    return text[:-1] if text.endswith("\n") else text


def iter_documents(path: str, text_field: str = "text") -> Iterator[str]:
    """Yields the documents of one input file (see module docstring).

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: undecodable UTF-8, a bad JSONL line or a missing/non-string
        ``text_field`` (the message names ``path`` and the line number).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"input file not found: {path}")
    jsonl = _is_jsonl(path)
    lineno = 0
    try:
        with _open_text(path) as f:
            if jsonl:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
                    if not isinstance(obj, dict) or text_field not in obj:
                        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                        raise ValueError(
                            f"{path}:{lineno}: no text field {text_field!r} (found: {keys}); "
                            "set --text_field"
                        )
                    text = obj[text_field]
                    if not isinstance(text, str):
                        raise ValueError(
                            f"{path}:{lineno}: field {text_field!r} is "
                            f"{type(text).__name__}, expected a string"
                        )
                    if text.strip():
                        yield text
            else:
                lines: list[str] = []
                for lineno, line in enumerate(f, 1):
                    if line.rstrip("\r\n") == EOT_TOKEN:
                        text = _strip_newline("".join(lines))
                        lines.clear()
                        if text.strip():
                            yield text
                    else:
                        lines.append(line)
                text = _strip_newline("".join(lines))
                if text.strip():
                    yield text
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 near line {lineno + 1} ({e.reason})") from None
    except (lzma.LZMAError, gzip.BadGzipFile, EOFError, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise ValueError(f"{path}: cannot read ({e})") from None


def _chunks(docs: Iterable[str], chunk_chars: int) -> Iterator[list[str]]:
    """Groups documents into lists of about ``chunk_chars`` characters."""
    chunk, size = [], 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc)
        if size >= chunk_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


# ----------------------------------------------------------------------------
# Tokenizer


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_tokenizer(path: str):
    """Loads an HF ``tokenizers`` JSON tokenizer, with a clear error if missing."""
    from tokenizers import Tokenizer

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises plain Exception subclasses
        raise ValueError(f"{path}: not a valid tokenizers JSON file ({e})") from None


def resolve_eot(tokenizer, eot_token: str = EOT_TOKEN) -> tuple[int, int]:
    """Returns ``(eot_id, vocab_size)`` for the token stream (see module docstring)."""
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    for tok in (eot_token, *FALLBACK_EOT_TOKENS):
        tid = tokenizer.token_to_id(tok)
        if tid is not None:
            return tid, vocab_size
    return vocab_size, vocab_size + 1


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class _Encoder:
    """Encodes a list of documents into one flat id array with eot after each."""

    def __init__(self, tokenizer_path: str, eot_token: str):
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.eot_id, vocab_size = resolve_eot(self.tokenizer, eot_token)
        self.dtype = token_dtype(vocab_size)

    def __call__(self, docs: list[str]) -> tuple[np.ndarray, int, int]:
        """Returns ``(ids, num_docs, num_utf8_bytes)``."""
        encs = self.tokenizer.encode_batch_fast(docs, add_special_tokens=False)
        lengths = np.fromiter((len(e.ids) + 1 for e in encs), np.int64, len(encs))
        out = np.empty(int(lengths.sum()), self.dtype)
        ends = np.cumsum(lengths)
        for e, end, n in zip(encs, ends, lengths):
            out[end - n : end - 1] = e.ids
        out[ends - 1] = self.eot_id
        num_bytes = sum(len(d.encode("utf-8")) for d in docs)
        return out, len(docs), num_bytes


_worker_encoder: _Encoder | None = None


def _worker_init(tokenizer_path: str, eot_token: str) -> None:
    global _worker_encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    _worker_encoder = _Encoder(tokenizer_path, eot_token)


def _worker_encode(docs: list[str]):
    return _worker_encoder(docs)


def _encode_stream(chunks: Iterator[list[str]], tokenizer_path: str, eot_token: str,
                   workers: int) -> Iterator[tuple[np.ndarray, int, int]]:
    """Encodes chunks in order; with ``workers > 1`` in a process pool, keeping
    at most ``2 * workers`` chunks in flight (bounded memory)."""
    if workers <= 1:
        enc = _Encoder(tokenizer_path, eot_token)
        for chunk in chunks:
            yield enc(chunk)
        return
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_worker_init, initargs=(tokenizer_path, eot_token)
    ) as pool:
        pending: collections.deque = collections.deque()
        for chunk in chunks:
            pending.append(pool.submit(_worker_encode, chunk))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


# ----------------------------------------------------------------------------
# Writing shards


class _ShardWriter:
    """Appends token arrays to ``shard_%05d.bin`` files of ``shard_tokens`` each."""

    def __init__(self, split_dir: str, dtype: np.dtype, shard_tokens: int):
        self.split_dir, self.dtype, self.shard_tokens = split_dir, dtype, shard_tokens
        self.shards: list[dict] = []
        self._f = None

    def write(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype.newbyteorder("<"), copy=False)
        while ids.size:
            if self._f is None or self.shards[-1]["num_tokens"] >= self.shard_tokens:
                self._roll()
            room = self.shard_tokens - self.shards[-1]["num_tokens"]
            part, ids = ids[:room], ids[room:]
            part.tofile(self._f)
            self.shards[-1]["num_tokens"] += int(part.size)

    def _roll(self) -> None:
        if self._f is not None:
            self._f.close()
        name = f"shard_{len(self.shards):05d}.bin"
        self._f = open(os.path.join(self.split_dir, name), "wb")
        self.shards.append({"file": name, "num_tokens": 0})

    def close(self) -> list[dict]:
        if self._f is not None:
            self._f.close()
        return self.shards


def write_json_atomic(path: str, obj) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def prepare_split(
    inputs: Sequence[str],
    tokenizer_path: str,
    output_dir: str,
    split: str = "train",
    *,
    text_field: str = "text",
    workers: int = 0,
    eot_token: str = EOT_TOKEN,
    shard_tokens: int = 1 << 28,
    chunk_chars: int = 1 << 20,
    progress: bool = True,
    progress_every_s: float = 5.0,
) -> dict:
    """Tokenizes ``inputs`` (in order) into ``output_dir/split`` and returns its meta.

    Args:
      inputs: text / JSONL files (see module docstring).
      tokenizer_path: HF ``tokenizers`` JSON file; copied to
        ``output_dir/tokenizer.json``.
      output_dir: dataset directory; an existing ``output_dir/split`` is replaced.
      split: split name (sub-directory).
      text_field: JSONL field holding the document text.
      workers: tokenizer processes; 0 or 1 tokenizes in this process
        (``encode_batch_fast`` is still multi-threaded in Rust).
      eot_token: end-of-text token looked up in the tokenizer.
      shard_tokens: tokens per shard file (default 2**28: 512 MiB of uint16).
      chunk_chars: characters per ``encode_batch`` call / work item.
      progress: print progress lines to stderr.

    Returns:
      The meta dict written to ``meta.json``: ``format_version, split, dtype,
      vocab_size, eot_id, num_tokens`` (eot ids included), ``num_documents,
      num_bytes`` (UTF-8 bytes of the document texts, separators excluded),
      ``bytes_per_token, tokenizer {path, sha256, vocab_size}, shards [{file,
      num_tokens}], inputs, text_field``.
    """
    inputs = [os.fspath(p) for p in inputs]
    tokenizer_path, output_dir = os.fspath(tokenizer_path), os.fspath(output_dir)
    if not inputs:
        raise ValueError("no input files given")
    for p in inputs:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"input file not found: {p}")
    tok = load_tokenizer(tokenizer_path)
    eot_id, vocab_size = resolve_eot(tok, eot_token)
    dtype = token_dtype(vocab_size)
    tok_vocab = tok.get_vocab_size(with_added_tokens=True)
    del tok

    os.makedirs(output_dir, exist_ok=True)
    tok_copy = os.path.join(output_dir, "tokenizer.json")
    if os.path.abspath(tok_copy) != os.path.abspath(tokenizer_path):
        shutil.copyfile(tokenizer_path, tok_copy)
    split_dir = os.path.join(output_dir, split)
    if os.path.isdir(split_dir):
        shutil.rmtree(split_dir)
    os.makedirs(split_dir)

    def all_docs():
        for p in inputs:
            yield from iter_documents(p, text_field)

    writer = _ShardWriter(split_dir, dtype, shard_tokens)
    n_tok = n_docs = n_bytes = 0
    t0 = last = time.perf_counter()

    def report(final=False):
        dt = max(time.perf_counter() - t0, 1e-9)
        msg = (f"[prepare] {split}: {n_docs:,} docs, {n_tok:,} tokens, "
               f"{n_bytes / 1e6:,.1f} MB text, {n_bytes / 1e6 / dt:.2f} MB/s")
        if final:
            msg += f"; done in {dt:.1f} s, {n_bytes / n_tok:.3f} bytes/token -> {split_dir}"
        print(msg, file=sys.stderr, flush=True)

    try:
        for ids, d, b in _encode_stream(_chunks(all_docs(), chunk_chars), tokenizer_path,
                                        eot_token, workers):
            writer.write(ids)
            n_tok, n_docs, n_bytes = n_tok + ids.size, n_docs + d, n_bytes + b
            if progress and time.perf_counter() - last >= progress_every_s:
                last = time.perf_counter()
                report()
    finally:
        shards = writer.close()
    if n_tok == 0:
        raise ValueError(f"no documents found in {', '.join(inputs)}")
    meta = {
        "format_version": FORMAT_VERSION,
        "split": split,
        "dtype": dtype.name,
        "vocab_size": vocab_size,
        "eot_id": eot_id,
        "num_tokens": n_tok,
        "num_documents": n_docs,
        "num_bytes": n_bytes,
        "bytes_per_token": n_bytes / n_tok,
        "tokenizer": {
            "path": os.path.abspath(tokenizer_path),
            "sha256": file_sha256(tokenizer_path),
            "vocab_size": tok_vocab,
        },
        "shards": shards,
        "inputs": [os.path.abspath(p) for p in inputs],
        "text_field": text_field,
    }
    write_json_atomic(os.path.join(split_dir, META_FILE), meta)
    if progress:
        report(final=True)
    return meta


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m mhar_jax.data.prepare",
        description="Tokenize text/JSONL files into uint16/uint32 token shards + meta.json.",
    )
    ap.add_argument("--input", nargs="+", required=True, metavar="FILE",
                    help="text (<|endoftext|>-separated) or .jsonl files, optionally .xz/.gz")
    ap.add_argument("--tokenizer", required=True, help="HF tokenizers JSON file")
    ap.add_argument("--output", required=True, help="dataset directory")
    ap.add_argument("--split", default="train", help="split name (default: train)")
    ap.add_argument("--text_field", default="text", help="JSONL text field (default: text)")
    ap.add_argument("--workers", type=int, default=0,
                    help="tokenizer processes (default: 0 = in-process)")
    ap.add_argument("--eot_token", default=EOT_TOKEN,
                    help="end-of-text token (default: <|endoftext|>)")
    ap.add_argument("--shard_tokens", type=int, default=1 << 28, help="tokens per shard file")
    args = ap.parse_args(argv)
    try:
        meta = prepare_split(
            args.input, args.tokenizer, args.output, args.split, text_field=args.text_field,
            workers=args.workers, eot_token=args.eot_token, shard_tokens=args.shard_tokens,
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: meta[k] for k in ("split", "dtype", "vocab_size", "eot_id", "num_tokens",
                                           "num_documents", "num_bytes", "bytes_per_token")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
