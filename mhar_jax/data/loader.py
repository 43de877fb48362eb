"""Grain loaders over the token shards written by ``mhar_jax.data.prepare``.

A split is one token stream ``t`` of ``N = meta["num_tokens"]`` ids (documents
joined, each followed by ``eot_id``), memory-mapped from its shards. It is cut
into ``W = (N - 1) // seq_len`` packed windows of ``seq_len + 1`` tokens,

    window[i] = t[i * seq_len : i * seq_len + seq_len + 1]
    inputs[i] = window[i][:-1],   targets[i] = window[i][1:]

so windows cross document boundaries (the model sees ``eot`` between
documents) and consecutive windows overlap by one token.

Training order: a grain ``MapDataset.range(W).shuffle(h(seed)).repeat(num_epochs)``
of window ids (each epoch reshuffled differently), cut into consecutive
global batches of ``global_batch`` ids. Process ``p`` of ``P`` reads rows
``[p * B, (p + 1) * B)`` of every global batch, ``B = global_batch // P``, so
concatenating the local batches of all processes in process order gives exactly
the single-process global batch for the same seed.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterator

import grain
import numpy as np

from mhar_jax.data.prepare import META_FILE
from mhar_jax.data.tokenizer_info import tokenizer_vocab_size  # noqa: F401 (re-export)

Batch = dict[str, np.ndarray]
EVAL_SPLIT_KEY = "data.val_splits"  # config key named in errors about eval splits


# ----------------------------------------------------------------------------
# Metadata and start-up checks


def load_meta(data_dir: str, split: str) -> dict:
    """Reads ``data_dir/split/meta.json`` (no validation, see ``check_data_dir``)."""
    with open(os.path.join(data_dir, split, META_FILE)) as f:
        return json.load(f)


def available_splits(data_dir: str) -> list[str]:
    """Sub-directories of ``data_dir`` that hold a ``meta.json``."""
    if not os.path.isdir(data_dir):
        return []
    return sorted(d for d in os.listdir(data_dir)
                  if os.path.isfile(os.path.join(data_dir, d, META_FILE)))


def check_data_dir(data_dir: str, split: str, *, dir_key: str = "data.data_dir",
                   split_key: str = "data.train_split") -> dict:
    """Validates a prepared split and returns its meta.

    Checks that ``data_dir`` exists, that ``split`` has a readable ``meta.json``
    with at least 2 tokens, and that every shard file exists with the size the
    meta says.

    Raises:
      ValueError: naming the config key (``dir_key`` / ``split_key``) and value.
    """
    if not data_dir or not os.path.isdir(data_dir):
        raise ValueError(
            f"config {dir_key}={data_dir!r}: directory does not exist; create it with "
            "`python -m mhar_jax.data.prepare --output DIR ...` or use "
            "mhar_jax.data.ensure_tiny_dataset()"
        )
    meta_path = os.path.join(data_dir, split, META_FILE)
    if not os.path.isfile(meta_path):
        raise ValueError(
            f"config {split_key}={split!r}: no split {split!r} in {dir_key}={data_dir!r} "
            f"(missing {meta_path}; available splits: {available_splits(data_dir) or 'none'})"
        )
    try:
        meta = load_meta(data_dir, split)
        n_tok, dtype, shards = int(meta["num_tokens"]), np.dtype(meta["dtype"]), meta["shards"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"config {split_key}={split!r}: unreadable {meta_path} ({e!r})") from None
    if n_tok < 2:
        raise ValueError(f"config {split_key}={split!r}: split in {dir_key}={data_dir!r} is "
                         f"empty ({n_tok} tokens)")
    for s in shards:
        path = os.path.join(data_dir, split, s["file"])
        want = int(s["num_tokens"]) * dtype.itemsize
        have = os.path.getsize(path) if os.path.isfile(path) else None
        if have != want:
            raise ValueError(f"config {split_key}={split!r}: shard {path} has "
                             f"{have} bytes, meta.json says {want}")
    if sum(int(s["num_tokens"]) for s in shards) != n_tok:
        raise ValueError(f"config {split_key}={split!r}: shard sizes in {meta_path} do not "
                         "add up to num_tokens")
    return meta


def bytes_per_token(data_dir: str, split: str) -> float:
    """UTF-8 text bytes per token of a split, ``num_bytes / num_tokens`` (eot ids
    count as tokens; separators are not text bytes)."""
    meta = load_meta(data_dir, split)
    return meta["num_bytes"] / meta["num_tokens"]


def bits_per_byte(loss_nats_per_token: float, bytes_per_tok: float) -> float:
    """``bpb = loss / ln(2) / bytes_per_token`` (= loss/ln 2 * tokens/bytes)."""
    return loss_nats_per_token / math.log(2) / bytes_per_tok


# ----------------------------------------------------------------------------
# Random access to the token stream


class TokenStream:
    """Random access to a split's concatenated shards via ``np.memmap``.

    Picklable (memmaps are reopened lazily after unpickling), so it can be
    used from grain worker processes.
    """

    def __init__(self, data_dir: str, split: str, *, split_key: str = "data.train_split"):
        self.data_dir, self.split = data_dir, split
        self.meta = check_data_dir(data_dir, split, split_key=split_key)
        self.dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
        self.files = [os.path.join(data_dir, split, s["file"]) for s in self.meta["shards"]]
        sizes = [int(s["num_tokens"]) for s in self.meta["shards"]]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.num_tokens = int(self.starts[-1])
        self._maps: list[np.memmap] | None = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_maps"] = None
        return state

    def _shards(self) -> list[np.memmap]:
        if self._maps is None:
            self._maps = [np.memmap(f, dtype=self.dtype, mode="r") for f in self.files]
        return self._maps

    def __len__(self) -> int:
        return self.num_tokens

    def read(self, start: int, stop: int) -> np.ndarray:
        """Returns ``tokens[start:stop]`` as int32 (``0 <= start <= stop <= N``)."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.num_tokens})")
        maps = self._shards()
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        out, pos = [], start
        while pos < stop:
            lo = pos - int(self.starts[k])
            hi = min(stop, int(self.starts[k + 1])) - int(self.starts[k])
            out.append(maps[k][lo:hi])
            pos += hi - lo
            k += 1
        return np.concatenate(out).astype(np.int32) if len(out) != 1 else out[0].astype(np.int32)

    def num_windows(self, seq_len: int) -> int:
        """``(N - 1) // seq_len``: packed windows of ``seq_len + 1`` tokens."""
        return (self.num_tokens - 1) // seq_len

    def windows(self, ids, seq_len: int) -> np.ndarray:
        """int32 ``[len(ids), seq_len + 1]``: row r = tokens of window ``ids[r]``."""
        return np.stack([self.read(i * seq_len, i * seq_len + seq_len + 1) for i in ids])


def _to_batch(windows: np.ndarray) -> Batch:
    return {"inputs": np.ascontiguousarray(windows[:, :-1]),
            "targets": np.ascontiguousarray(windows[:, 1:])}


class _LocalBatches(grain.MapDataset):
    """Element j: this process's rows of global batch j of the window-id order.

    ``parent[j * global_batch + row_start + r]`` for ``r < local_batch`` gives
    the window ids; the element is ``{"inputs", "targets"}`` int32
    ``[local_batch, seq_len]``.
    """

    def __init__(self, order: grain.MapDataset, stream: TokenStream, *, seq_len: int,
                 global_batch: int, row_start: int, local_batch: int):
        super().__init__(order)
        self._stream, self._seq_len = stream, seq_len
        self._global_batch, self._row_start, self._local_batch = global_batch, row_start, local_batch

    def __len__(self) -> int:
        return len(self._parent) // self._global_batch

    def __str__(self) -> str:
        return f"_LocalBatches(global_batch={self._global_batch}, rows=[{self._row_start}, " \
               f"{self._row_start + self._local_batch}))"

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        base = index * self._global_batch + self._row_start
        ids = [self._parent[base + r] for r in range(self._local_batch)]
        return _to_batch(self._stream.windows(ids, self._seq_len))


def _check_sharding(global_batch: int, process_index: int, process_count: int) -> int:
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"bad process_index={process_index} / process_count={process_count}")
    if global_batch < 1 or global_batch % process_count:
        raise ValueError(f"global batch {global_batch} is not a positive multiple of "
                         f"process_count={process_count}")
    return global_batch // process_count


def make_train_dataset(data_dir: str, split: str, *, seq_len: int, global_batch: int, seed: int,
                       process_index: int = 0, process_count: int = 1, shuffle: bool = True,
                       num_epochs: int | None = None) -> grain.MapDataset:
    """The ``grain.MapDataset`` of local batches behind ``make_train_iterator``.

    Element j is process ``process_index``'s slice of global batch j:
    ``{"inputs", "targets"}`` int32 ``[global_batch // process_count, seq_len]``.
    Its length is ``num_epochs * W // global_batch`` (``sys.maxsize // global_batch``
    for ``num_epochs=None``); a global batch may straddle two epochs.
    """
    local_batch = _check_sharding(global_batch, process_index, process_count)
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    stream = TokenStream(data_dir, split)
    n = stream.num_windows(seq_len)
    if n < 1:
        raise ValueError(f"split {split!r} in {data_dir!r} has {stream.num_tokens} tokens, "
                         f"fewer than seq_len + 1 = {seq_len + 1}")
    order = grain.MapDataset.range(n)
    if shuffle:  # hash the seed: grain reshuffles epoch e with seed + e
        order = order.shuffle(seed=int(np.random.SeedSequence(seed).generate_state(1)[0]))
    order = order.repeat(num_epochs)
    if len(order) < global_batch:
        raise ValueError(f"split {split!r} has {len(order)} windows of {seq_len + 1} tokens "
                         f"over {num_epochs} epoch(s), fewer than global_batch={global_batch}")
    return _LocalBatches(order, stream, seq_len=seq_len, global_batch=global_batch,
                         row_start=process_index * local_batch, local_batch=local_batch)


def make_train_iterator(data_dir: str, split: str, *, seq_len: int, global_batch: int, seed: int,
                        process_index: int = 0, process_count: int = 1, shuffle: bool = True,
                        num_epochs: int | None = None, worker_count: int = 0,
                        read_threads: int = 2, prefetch: int = 4) -> grain.DatasetIterator:
    """Checkpointable iterator of this process's training batches.

    ``next(it)`` gives ``{"inputs": int32[B, seq_len], "targets": int32[B, seq_len]}``,
    ``B = global_batch // process_count``, ``targets[:, t] = inputs[:, t + 1]``
    within the packed window (see module docstring for order and sharding).
    Repeats forever when ``num_epochs`` is None, else raises StopIteration after
    ``num_epochs * W // global_batch`` batches.

    ``it.get_state()`` returns a JSON-serialisable dict; ``it.set_state(state)``
    on a fresh iterator built with the same arguments resumes at exactly the next
    batch (the state depends on ``worker_count``, so keep it fixed across restarts).

    Args:
      worker_count: grain ``mp_prefetch`` worker processes (0 = none).
      read_threads, prefetch: grain ``ReadOptions`` for the in-process reader
        (threads, and buffered batches: keep small, batches can be large).
    """
    ds = make_train_dataset(data_dir, split, seq_len=seq_len, global_batch=global_batch,
                            seed=seed, process_index=process_index,
                            process_count=process_count, shuffle=shuffle, num_epochs=num_epochs)
    it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads,
                                                 prefetch_buffer_size=prefetch))
    if worker_count > 0:
        from absl import flags  # grain's worker processes read its absl flags

        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count))
    return iter(it_ds)


def num_eval_batches(data_dir: str, split: str, *, seq_len: int, batch: int,
                     max_batches: int | None = None) -> int:
    """Number of batches ``make_eval_batches`` yields: ``min(W // batch, max_batches)``."""
    n = TokenStream(data_dir, split, split_key=EVAL_SPLIT_KEY).num_windows(seq_len) // batch
    return n if max_batches is None else min(n, max_batches)


def make_eval_batches(data_dir: str, split: str, *, seq_len: int, batch: int,
                      max_batches: int | None = None, process_index: int = 0,
                      process_count: int = 1) -> Iterator[Batch]:
    """Deterministic in-order pass over a split (e.g. validation).

    Yields ``num_eval_batches(...)`` dicts ``{"inputs", "targets"}`` int32
    ``[batch // process_count, seq_len]``: global batch j holds windows
    ``j * batch ... (j + 1) * batch - 1`` in order (windows as in training, no
    shuffling); the trailing ``W % batch`` windows (and the last
    ``(N - 1) % seq_len`` tokens) are dropped. Process p gets rows
    ``[p * B, (p + 1) * B)`` of each global batch, as in training.
    Every call starts a new pass; validation is done eagerly, reading is lazy.
    """
    local = _check_sharding(batch, process_index, process_count)
    stream = TokenStream(data_dir, split, split_key=EVAL_SPLIT_KEY)
    n = stream.num_windows(seq_len) // batch
    n = n if max_batches is None else min(n, max_batches)
    if n < 1:
        raise ValueError(f"split {split!r} in {data_dir!r} has {stream.num_tokens} tokens, "
                         f"too few for one eval batch of {batch} x {seq_len + 1}")

    def gen():
        for j in range(n):
            start = (j * batch + process_index * local) * seq_len
            flat = stream.read(start, start + local * seq_len + 1)
            yield _to_batch(np.lib.stride_tricks.sliding_window_view(flat, seq_len + 1)[::seq_len])

    return gen()


def state_to_bytes(state: dict[str, Any]) -> bytes:
    """Iterator state as UTF-8 JSON bytes (for checkpoints)."""
    return json.dumps(state, sort_keys=True).encode()


def state_from_bytes(data: bytes) -> dict[str, Any]:
    return json.loads(data.decode())


__all__ = [
    "TokenStream", "available_splits", "bits_per_byte", "bytes_per_token", "check_data_dir",
    "load_meta", "make_eval_batches", "make_train_dataset", "make_train_iterator",
    "num_eval_batches", "state_from_bytes", "state_to_bytes", "tokenizer_vocab_size",
]
