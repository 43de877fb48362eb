"""Tests for mhar_jax.data: prepare (tokenize to shards), grain loader, tiny corpus."""

import gzip
import json
import lzma
import os

import numpy as np
import pytest

from mhar_jax.data import prepare, tiny
from mhar_jax.data import (
    TINY_TOKENIZER, TokenStream, bits_per_byte, bytes_per_token, check_data_dir,
    ensure_tiny_dataset, load_meta, make_eval_batches, make_train_iterator, num_eval_batches,
    prepare_split, state_from_bytes, state_to_bytes, tokenizer_eot_id, tokenizer_vocab_size,
)

DOCS = [
    "Hello world.\nThis is the first document.",
    "Second document: naïve café, 日本語, emoji 🙂.\n\n  indented line",
    "def f(x):\n    return x + 1\n",
]


def _write_text(path, docs, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(f"{d}\n{prepare.EOT_TOKEN}\n")


def _tokenizer():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(TINY_TOKENIZER)


# ----------------------------------------------------------------------------
# prepare


def test_prepare_text_counts_and_eot(tmp_path):
    src = tmp_path / "a.txt"
    _write_text(src, DOCS[:2])
    with open(src, "a", encoding="utf-8") as f:
        # A blank document (skipped), then a last document without a final separator
        # (its final newline belongs to the format, like the one before a separator).
        f.write("\n   \n" + prepare.EOT_TOKEN + "\n" + DOCS[2] + "\n")
    meta = prepare_split([src], TINY_TOKENIZER, tmp_path / "out", "train", progress=False)
    tok = _tokenizer()
    eot = tok.token_to_id(prepare.EOT_TOKEN)
    want = []
    for d in DOCS:
        want += tok.encode(d, add_special_tokens=False).ids + [eot]
    got = TokenStream(str(tmp_path / "out"), "train").read(0, meta["num_tokens"])
    assert got.tolist() == want
    assert meta["eot_id"] == eot == 0 and meta["dtype"] == "uint16"
    assert meta["vocab_size"] == tokenizer_vocab_size(TINY_TOKENIZER) == 2048
    assert meta["num_documents"] == 3 and meta["num_tokens"] == len(want)
    assert meta["num_bytes"] == sum(len(d.encode("utf-8")) for d in DOCS)
    assert meta["tokenizer"]["sha256"] == prepare.file_sha256(TINY_TOKENIZER)
    assert json.load(open(tmp_path / "out" / "train" / "meta.json")) == meta
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == open(TINY_TOKENIZER, "rb").read()
    # Documents decode back exactly.
    ends = np.flatnonzero(got == eot)
    starts = np.concatenate([[0], ends[:-1] + 1])
    assert [tok.decode(got[a:b].tolist()) for a, b in zip(starts, ends)] == DOCS


def test_prepare_formats_agree(tmp_path):
    """.txt, .txt.xz, .txt.gz, .jsonl and .jsonl.xz give identical token streams."""
    _write_text(tmp_path / "d.txt", DOCS)
    _write_text(tmp_path / "d.txt.xz", DOCS, lzma.open)
    _write_text(tmp_path / "d.txt.gz", DOCS, gzip.open)
    lines = "".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(DOCS)) + "\n"
    (tmp_path / "d.jsonl").write_text(lines, encoding="utf-8")
    with lzma.open(tmp_path / "d.jsonl.xz", "wt", encoding="utf-8") as f:
        f.write(lines)
    streams, metas = [], []
    for name in ["d.txt", "d.txt.xz", "d.txt.gz", "d.jsonl", "d.jsonl.xz"]:
        m = prepare_split([tmp_path / name], TINY_TOKENIZER, tmp_path / "o", name.replace(".", "_"),
                          text_field="body", progress=False)
        streams.append(TokenStream(str(tmp_path / "o"), m["split"]).read(0, m["num_tokens"]))
        metas.append((m["num_tokens"], m["num_documents"], m["num_bytes"]))
    assert all(np.array_equal(s, streams[0]) for s in streams)
    assert len(set(metas)) == 1


def test_prepare_shards_workers_and_concat(tmp_path):
    """Several inputs concatenate in order; small shards and workers give the same stream."""
    docs = [f"document {i}: " + "word " * (i % 17) for i in range(200)]
    _write_text(tmp_path / "a.txt", docs[:120])
    _write_text(tmp_path / "b.txt", docs[120:])
    _write_text(tmp_path / "all.txt", docs)
    ref = prepare_split([tmp_path / "all.txt"], TINY_TOKENIZER, tmp_path / "o", "ref", progress=False)
    m = prepare_split([tmp_path / "a.txt", tmp_path / "b.txt"], TINY_TOKENIZER, tmp_path / "o",
                      "sharded", shard_tokens=333, chunk_chars=500, workers=2, progress=False)
    assert len(m["shards"]) == -(-ref["num_tokens"] // 333) > 3
    a = TokenStream(str(tmp_path / "o"), "ref")
    b = TokenStream(str(tmp_path / "o"), "sharded")
    assert np.array_equal(a.read(0, len(a)), b.read(0, len(b)))
    assert np.array_equal(b.read(330, 1000), a.read(330, 1000))  # crosses shard boundaries
    assert m["num_documents"] == 200 and m["num_bytes"] == ref["num_bytes"]


def test_prepare_eot_fallback(tmp_path):
    """A tokenizer without an end-of-text token gets eot_id = vocab_size."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(tmp_path / "tok.json"))
    _write_text(tmp_path / "d.txt", DOCS)
    m = prepare_split([tmp_path / "d.txt"], tmp_path / "tok.json", tmp_path / "o", progress=False)
    n = tok.get_vocab_size()
    assert m["eot_id"] == n and m["vocab_size"] == n + 1 and m["tokenizer"]["vocab_size"] == n
    assert (TokenStream(str(tmp_path / "o"), "train").read(0, m["num_tokens"]) == n).sum() == 3


def test_prepare_errors(tmp_path, capsys):
    out = tmp_path / "o"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        prepare_split([tmp_path / "nope.txt"], TINY_TOKENIZER, out, progress=False)
    (tmp_path / "ok.txt").write_text("hi\n")
    with pytest.raises(FileNotFoundError, match="tok.json"):
        prepare_split([tmp_path / "ok.txt"], tmp_path / "tok.json", out, progress=False)
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: invalid JSON"):
        prepare_split([tmp_path / "bad.jsonl"], TINY_TOKENIZER, out, progress=False)
    (tmp_path / "nofield.jsonl").write_text('{"text": "a"}\n{"content": "b"}\n')
    with pytest.raises(ValueError, match=r"nofield\.jsonl:2: no text field 'text'.*content"):
        prepare_split([tmp_path / "nofield.jsonl"], TINY_TOKENIZER, out, progress=False)
    (tmp_path / "num.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(ValueError, match=r"num\.jsonl:1: field 'text' is int"):
        prepare_split([tmp_path / "num.jsonl"], TINY_TOKENIZER, out, progress=False)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt: not valid UTF-8"):
        prepare_split([tmp_path / "latin1.txt"], TINY_TOKENIZER, out, progress=False)
    (tmp_path / "empty.txt").write_text(f"\n{prepare.EOT_TOKEN}\n")
    with pytest.raises(ValueError, match="no documents"):
        prepare_split([tmp_path / "empty.txt"], TINY_TOKENIZER, out, progress=False)
    # The CLI reports errors on stderr with exit status 2.
    rc = prepare.main(["--input", str(tmp_path / "nope.txt"), "--tokenizer", TINY_TOKENIZER,
                       "--output", str(out)])
    assert rc == 2 and "nope.txt" in capsys.readouterr().err


def test_prepare_cli(tmp_path, capsys):
    _write_text(tmp_path / "d.txt", DOCS)
    rc = prepare.main(["--input", str(tmp_path / "d.txt"), "--tokenizer", TINY_TOKENIZER,
                       "--output", str(tmp_path / "o"), "--split", "val"])
    out = capsys.readouterr()
    assert rc == 0 and json.loads(out.out)["num_documents"] == 3 and "[prepare] val" in out.err
    assert check_data_dir(str(tmp_path / "o"), "val")["num_documents"] == 3


# ----------------------------------------------------------------------------
# loader (synthetic token stream t[i] = i, so window w starts with w * seq_len)


def _arange_split(root, split, n, shard_tokens=None, num_bytes=None):
    d = os.path.join(root, split)
    os.makedirs(d)
    toks = np.arange(n, dtype=np.uint32)
    shard_tokens = shard_tokens or max(n, 1)
    shards = []
    for k, a in enumerate(range(0, max(n, 1), shard_tokens)):
        part = toks[a:a + shard_tokens]
        part.tofile(os.path.join(d, f"shard_{k:05d}.bin"))
        shards.append({"file": f"shard_{k:05d}.bin", "num_tokens": int(part.size)})
    meta = {"dtype": "uint32", "vocab_size": 1 << 20, "eot_id": 0, "num_tokens": n,
            "num_documents": 1, "num_bytes": num_bytes or 3 * n, "shards": shards}
    json.dump(meta, open(os.path.join(d, "meta.json"), "w"))
    return str(root)


@pytest.fixture
def data_dir(tmp_path):
    # 1601 tokens, seq_len 16 -> W = 100 windows; shards of 250 tokens.
    return _arange_split(tmp_path, "train", 1601, shard_tokens=250)


def _take(it, k):
    return [next(it) for _ in range(k)]


def _it(data_dir, **kw):
    args = dict(seq_len=16, global_batch=8, seed=3)
    args.update(kw)
    return make_train_iterator(data_dir, "train", **args)


def test_loader_shapes_and_windows(data_dir):
    for b in _take(_it(data_dir), 30):  # 30 * 8 > 100 windows: wraps over epochs
        assert set(b) == {"inputs", "targets"}
        for x in b.values():
            assert x.shape == (8, 16) and x.dtype == np.int32
        np.testing.assert_array_equal(b["targets"][:, :-1], b["inputs"][:, 1:])
        start = b["inputs"][:, :1]
        assert np.all(start % 16 == 0) and np.all(start < 1600)
        np.testing.assert_array_equal(b["inputs"], start + np.arange(16))
        np.testing.assert_array_equal(b["targets"], start + 1 + np.arange(16))


def test_loader_epochs_shuffle_and_seeds(data_dir):
    def windows(batches):
        return [int(w) for b in batches for w in b["inputs"][:, 0] // 16]

    one = windows(list(_it(data_dir, num_epochs=1)))
    assert len(one) == 96 and len(set(one)) == 96 and one != sorted(one)  # 100 // 8 batches
    two = windows(list(_it(data_dir, num_epochs=2)))
    assert len(two) == 200 and sorted(two) == sorted(list(range(100)) * 2)
    assert two[:100] != two[100:]  # reshuffled each epoch
    assert windows(list(_it(data_dir, num_epochs=1, shuffle=False))) == list(range(96))
    a, b, c = (windows(_take(_it(data_dir, seed=s), 20)) for s in (3, 3, 4))
    assert a == b and a != c


@pytest.mark.parametrize("process_count", [2, 4])
def test_loader_process_sharding_union(data_dir, process_count):
    """Concatenating the process-local batches gives the single-process batch."""
    ref = _take(_it(data_dir, global_batch=16), 15)  # crosses epoch boundaries
    parts = [_take(_it(data_dir, global_batch=16, process_index=p, process_count=process_count), 15)
             for p in range(process_count)]
    for step, want in enumerate(ref):
        for key in ("inputs", "targets"):
            got = np.concatenate([parts[p][step][key] for p in range(process_count)])
            np.testing.assert_array_equal(got, want[key])
            assert parts[0][step][key].shape == (16 // process_count, 16)


@pytest.mark.parametrize("process_index,process_count", [(0, 1), (1, 2)])
def test_loader_state_restore(data_dir, process_index, process_count):
    kw = dict(process_index=process_index, process_count=process_count)
    it = _it(data_dir, **kw)
    _take(it, 5)
    state = it.get_state()
    blob = state_to_bytes(state)
    json.dumps(state)  # JSON-serialisable
    after = _take(it, 3)
    it2 = _it(data_dir, **kw)
    it2.set_state(state_from_bytes(blob))
    for a, b in zip(after, _take(it2, 3)):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
        np.testing.assert_array_equal(a["targets"], b["targets"])
    ref = _take(_it(data_dir, **kw), 8)[5:]
    np.testing.assert_array_equal(ref[0]["inputs"], after[0]["inputs"])


def test_loader_bad_args(data_dir):
    with pytest.raises(ValueError, match="multiple of process_count"):
        _it(data_dir, global_batch=6, process_count=4)
    with pytest.raises(ValueError, match="process_index"):
        _it(data_dir, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="seq_len"):
        _it(data_dir, seq_len=2000)
    with pytest.raises(ValueError, match="fewer than global_batch"):
        _it(data_dir, global_batch=128, num_epochs=1)


def test_eval_batches(data_dir):
    batches = list(make_eval_batches(data_dir, "train", seq_len=16, batch=8))
    assert len(batches) == num_eval_batches(data_dir, "train", seq_len=16, batch=8) == 12
    starts = np.concatenate([b["inputs"][:, 0] for b in batches])
    np.testing.assert_array_equal(starts, np.arange(96) * 16)
    for b in batches:
        assert b["inputs"].shape == b["targets"].shape == (8, 16) and b["inputs"].dtype == np.int32
        np.testing.assert_array_equal(b["targets"], b["inputs"] + 1)
    again = list(make_eval_batches(data_dir, "train", seq_len=16, batch=8, max_batches=5))
    assert len(again) == 5
    assert all(np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(again, batches))
    halves = [list(make_eval_batches(data_dir, "train", seq_len=16, batch=8, process_index=p,
                                     process_count=2)) for p in range(2)]
    for j, b in enumerate(batches):
        np.testing.assert_array_equal(np.concatenate([halves[0][j]["inputs"],
                                                      halves[1][j]["inputs"]]), b["inputs"])
    with pytest.raises(ValueError, match="too few"):
        make_eval_batches(data_dir, "train", seq_len=16, batch=128)
    with pytest.raises(ValueError, match=r"data\.val_splits='nope'"):
        make_eval_batches(data_dir, "nope", seq_len=16, batch=8)


def test_bytes_per_token_and_bpb(data_dir):
    assert bytes_per_token(data_dir, "train") == 3.0
    assert bits_per_byte(np.log(2) * 3.0, 3.0) == pytest.approx(1.0)


def test_check_data_dir_errors(tmp_path):
    missing = str(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"data\.data_dir=.*missing.*does not exist"):
        check_data_dir(missing, "train")
    root = _arange_split(tmp_path, "train", 100)
    with pytest.raises(ValueError, match=r"data\.train_split='val'.*available splits: \['train'\]"):
        check_data_dir(root, "val")
    with pytest.raises(ValueError, match=r"data\.eval_split='val'"):
        check_data_dir(root, "val", split_key="data.eval_split")
    _arange_split(tmp_path, "empty", 0)
    with pytest.raises(ValueError, match=r"data\.train_split='empty'.*empty \(0 tokens\)"):
        check_data_dir(root, "empty")
    with pytest.raises(ValueError, match="empty"):
        make_train_iterator(root, "empty", seq_len=4, global_batch=2, seed=0)
    (tmp_path / "train" / "shard_00000.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ValueError, match="shard_00000.bin has 10 bytes"):
        check_data_dir(root, "train")
    (tmp_path / "train" / "meta.json").write_text("{not json")
    with pytest.raises(ValueError, match="unreadable"):
        check_data_dir(root, "train")
    with pytest.raises(FileNotFoundError, match="no_tok.json"):
        tokenizer_vocab_size(str(tmp_path / "no_tok.json"))


# ----------------------------------------------------------------------------
# tiny shipped corpus


def test_tiny_dataset(tmp_path):
    d = ensure_tiny_dataset(str(tmp_path))
    assert ensure_tiny_dataset(str(tmp_path)) == d == tiny.resolve_data_dir("", str(tmp_path))
    assert tiny.resolve_data_dir("/some/dir") == "/some/dir"
    assert tokenizer_eot_id(TINY_TOKENIZER) == 0
    for split in ("train", "val"):
        m = check_data_dir(d, split)
        assert m["vocab_size"] == 2048 and m["eot_id"] == 0 and m["num_tokens"] > 10_000
        assert 2.5 < bytes_per_token(d, split) < 4.5
    assert load_meta(d, "train")["num_tokens"] > 10 * load_meta(d, "val")["num_tokens"]
    b = next(make_train_iterator(d, "train", seq_len=128, global_batch=4, seed=0))
    assert b["inputs"].shape == (4, 128) and b["inputs"].max() < 2048
    assert sum(1 for _ in make_eval_batches(d, "val", seq_len=128, batch=8)) >= 10
    assert tokenizer_vocab_size(os.path.join(d, "tokenizer.json")) == 2048
    total = sum(os.path.getsize(os.path.join(tiny.ASSETS_DIR, f)) for f in os.listdir(tiny.ASSETS_DIR))
    assert total < 2 * 2**20


@pytest.mark.slow
def test_loader_worker_processes(data_dir):
    """grain mp_prefetch workers give the same batches, and their state restores."""
    ref = _take(_it(data_dir), 8)
    it = _it(data_dir, worker_count=2)
    try:
        got = _take(it, 5)
        state = json.loads(json.dumps(it.get_state()))
        got += _take(it, 3)
        it.set_state(state)  # rewind the same iterator (new processes are slow to start)
        got2 = _take(it, 3)
    finally:
        it.close()
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
    for a, b in zip(ref[5:], got2):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
