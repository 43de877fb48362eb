"""Regenerates the tiny shipped corpus and tokenizer in ``mhar_jax/data/assets/``.

Run once by a developer (not at training time)::

    python -m mhar_jax.data.build_tiny_assets [--out mhar_jax/data/assets]

Offline source, the running Python's standard library (PSF licence):

* prose: every topic of ``pydoc_data.topics`` (the language-reference text that
  ``help()`` shows), cut at section headings into documents of about ``DOC_CHARS``
  characters;
* code: the source of a fixed list of pure-Python modules, cut at top-level
  statements into documents of about ``DOC_CHARS`` characters.

Every 10th document of each kind goes to validation. Written files:
``tiny_train.txt.xz``, ``tiny_val.txt.xz`` (``<|endoftext|>``-separated, like the
benchmark corpus) and ``tiny_tokenizer.json`` (byte-level BPE, ``VOCAB_SIZE``
entries, ``<|endoftext|>`` = id 0, trained on the training documents). The
output depends on the Python version (assets were built with 3.11.7).
"""

from __future__ import annotations

import argparse
import ast
import lzma
import os
import re
import sys
import sysconfig

from mhar_jax.data.prepare import EOT_TOKEN

VOCAB_SIZE = 2048
DOC_CHARS = 3000
VAL_EVERY = 10
CODE_MODULES = (
    "textwrap", "string", "functools", "heapq", "bisect", "fractions", "shlex", "calendar",
    "csv", "pprint", "queue", "contextlib", "copy", "fnmatch", "glob", "graphlib", "sched",
    "colorsys", "json/__init__", "json/decoder", "json/encoder", "base64",
)


def _group(blocks: list[str], header: str = "") -> list[str]:
    """Joins consecutive blocks into documents of at least ``DOC_CHARS`` chars."""
    docs, chunk = [], ""
    for block in blocks:
        chunk += block
        if len(chunk) >= DOC_CHARS:
            docs.append(header + chunk.strip("\n"))
            chunk = ""
    if chunk.strip():
        docs.append(header + chunk.strip("\n"))
    return docs


def prose_documents() -> list[str]:
    from pydoc_data.topics import topics

    docs = []
    for k in sorted(topics):
        # Cut before section headings (a line underlined with =, - or *).
        parts = re.split(r"\n(?=[^\n]+\n(?:=+|-+|\*+)\n)", topics[k].strip() + "\n")
        docs += _group([p + "\n" for p in parts])
    return docs


def code_documents() -> list[str]:
    stdlib = sysconfig.get_paths()["stdlib"]
    docs = []
    for name in CODE_MODULES:
        with open(os.path.join(stdlib, name + ".py"), encoding="utf-8") as f:
            src = f.read()
        lines = src.splitlines(keepends=True)
        starts = [min([n.lineno] + [d.lineno for d in getattr(n, "decorator_list", [])]) - 1
                  for n in ast.parse(src).body[1:]]
        cuts = [0] + starts + [len(lines)]
        docs += _group(["".join(lines[a:b]) for a, b in zip(cuts, cuts[1:])],
                       header=f"# Lib/{name}.py\n")
    return docs


def split_docs(docs: list[str]) -> tuple[list[str], list[str]]:
    return ([d for i, d in enumerate(docs) if i % VAL_EVERY != VAL_EVERY - 1],
            [d for i, d in enumerate(docs) if i % VAL_EVERY == VAL_EVERY - 1])


def write_corpus(path: str, docs: list[str]) -> None:
    text = "".join(f"{d}\n{EOT_TOKEN}\n" for d in docs)
    with lzma.open(path, "wb", preset=9 | lzma.PRESET_EXTREME) as f:
        f.write(text.encode("utf-8"))


def train_tokenizer(docs: list[str], path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    tok.save(path, pretty=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "assets"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    p_train, p_val = split_docs(prose_documents())
    c_train, c_val = split_docs(code_documents())
    train, val = p_train + c_train, p_val + c_val
    write_corpus(os.path.join(args.out, "tiny_train.txt.xz"), train)
    write_corpus(os.path.join(args.out, "tiny_val.txt.xz"), val)
    train_tokenizer(train, os.path.join(args.out, "tiny_tokenizer.json"))
    for name, docs in (("train", train), ("val", val)):
        print(f"{name}: {len(docs)} docs, {sum(len(d.encode()) for d in docs):,} bytes",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
