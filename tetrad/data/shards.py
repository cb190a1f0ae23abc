"""A prepared folder on disk: token shards, their document index, and ``index.json``.

Layout of a folder written by ``tetrad prepare`` (and of each cache entry)::

    job.json            what is being prepared (inputs, tokenizer, settings): written first
    tokenizer.json      the tokenizer the ids belong to
    shards/000000.bin   token ids, little-endian uint16 (vocabulary <= 65,535) or uint32, each
                        document followed by the end-of-document token (nanoGPT's .bin,
                        Megatron's .bin without its .idx header); memory-mapped with numpy
    shards/000000.npz   per document ending in the shard: ``doc_ends`` (int64, exclusive end
                        in the shard), ``buckets``/``ranks`` (split keys, tetrad.data.split);
                        ``counts`` (int64 [vocab]: token frequencies)
    shards/000000.json  the shard's marker, written last: tokens, documents, the input cursor
                        after it and the running totals; a shard without one is incomplete
    index.json          written when every shard is complete: the job, dtype, vocabulary size,
                        end token, tokenizer SHA-256, shards and totals

A document may continue across a shard boundary (the pieces of a large text file): its tokens
start where the previous document ends. A shard ends at the first batch boundary at or after
``shard_bytes`` of tokens, so shards depend on the input and settings only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import numpy as np

from tetrad.data.encode import Encoded
from tetrad.data.errors import DataError
from tetrad.data.sources import INDEX, PREPARED_FORMAT

FORMAT = PREPARED_FORMAT
VERSION = 1
TOKENIZER, SHARDS = "tokenizer.json", "shards"
SHARD_BYTES = 256 << 20
"""Default shard size: a shard closes at the first batch boundary at or beyond this many bytes
of tokens."""
TOTALS = (
    "documents",
    "tokens",
    "empty_documents",
    "non_utf8_documents",
    "non_utf8_bytes",
    "text_bytes",
    "done_bytes",
)
"""The running totals of a preparation (documents and tokens written, empty documents skipped,
documents with invalid UTF-8 and their bytes, UTF-8 bytes of text, input bytes consumed)."""


def write_json(path: pathlib.Path, obj: dict) -> None:
    """Write ``obj`` to ``path`` atomically (a temporary file renamed into place)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def read_json(path: pathlib.Path) -> dict | None:
    """The JSON object in ``path``, or None when it is missing or unreadable."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def shard_file(folder: pathlib.Path, i: int, ext: str) -> pathlib.Path:
    """``folder/shards/NNNNNN.ext``."""
    return folder / SHARDS / f"{i:06d}.{ext}"


def completed_shards(folder: pathlib.Path, itemsize: int) -> list[dict]:
    """The markers of the complete shards ``0, 1, ...`` of ``folder`` (a marker whose ``.bin``
    has its size and whose ``.npz`` exists); the files of any later shard are removed."""
    markers: list[dict] = []
    while True:
        m = read_json(shard_file(folder, len(markers), "json"))
        b, z = shard_file(folder, len(markers), "bin"), shard_file(folder, len(markers), "npz")
        if m is None or not z.is_file() or not b.is_file():
            break
        if b.stat().st_size != m["tokens"] * itemsize:
            break
        markers.append(m)
    for p in (folder / SHARDS).glob("*"):
        if not p.name[:6].isdigit() or int(p.name[:6]) >= len(markers):
            p.unlink()
    return markers


class ShardWriter:
    """Appends encoded batches to ``folder/shards``, completing a shard (``.npz`` then the
    ``.json`` marker) at the first batch boundary where it holds ``shard_bytes`` or more."""

    def __init__(
        self,
        folder: pathlib.Path,
        first: int,
        dtype: str,
        vocab_size: int,
        shard_bytes: int,
        totals: dict,
    ):
        self.folder, self.index, self.dtype = folder, first, np.dtype(dtype)
        self.vocab_size, self.shard_bytes = vocab_size, shard_bytes
        self.totals = {k: totals.get(k, 0) for k in TOTALS}
        self.markers: list[dict] = []
        (folder / SHARDS).mkdir(parents=True, exist_ok=True)
        self._f = None

    def _start(self) -> None:
        self._f = open(shard_file(self.folder, self.index, "bin"), "wb")
        self._tokens, self._docs = 0, 0
        self._ends: list[np.ndarray] = []
        self._buckets: list[np.ndarray] = []
        self._ranks: list[np.ndarray] = []
        self._counts = np.zeros(self.vocab_size, np.int64)

    def add(self, enc: Encoded, cursor, done_bytes: int) -> None:
        """Append ``enc`` (the batch ending at ``cursor``, after ``done_bytes`` input bytes)."""
        if self._f is None:
            self._start()
        tokens = enc.tokens.astype(self.dtype.newbyteorder("<"), copy=False)
        self._f.write(tokens.tobytes())
        self._ends.append(enc.doc_ends + self._tokens)
        self._buckets.append(enc.buckets)
        self._ranks.append(enc.ranks)
        self._counts += np.bincount(enc.tokens, minlength=self.vocab_size)[: self.vocab_size]
        self._tokens += len(tokens)
        self._docs += len(enc.doc_ends)
        t = self.totals
        t["documents"] += len(enc.doc_ends)
        t["tokens"] += len(tokens)
        t["empty_documents"] += enc.empty
        t["non_utf8_documents"] += enc.non_utf8_documents
        t["non_utf8_bytes"] += enc.non_utf8_bytes
        t["text_bytes"] += enc.text_bytes
        t["done_bytes"] = done_bytes
        if self._tokens * self.dtype.itemsize >= self.shard_bytes:
            self._complete(cursor)

    def _complete(self, cursor) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._f = None
        tmp = shard_file(self.folder, self.index, "tmp.npz")
        np.savez(
            tmp,
            doc_ends=np.concatenate(self._ends),
            buckets=np.concatenate(self._buckets),
            ranks=np.concatenate(self._ranks),
            counts=self._counts,
        )
        os.replace(tmp, shard_file(self.folder, self.index, "npz"))
        marker = {
            "tokens": self._tokens,
            "documents": self._docs,
            "cursor": list(cursor),
            "totals": dict(self.totals),
        }
        write_json(shard_file(self.folder, self.index, "json"), marker)
        self.markers.append(marker)
        self.index += 1

    def finish(self, cursor) -> None:
        """Complete the last shard (if it holds any token)."""
        if self._f is not None:
            if self._tokens:
                self._complete(cursor)
            else:
                self._f.close()
                shard_file(self.folder, self.index, "bin").unlink()
                self._f = None


@dataclasses.dataclass
class Prepared:
    """A complete prepared folder, opened.

    Attributes:
        folder: the folder; ``index``: its ``index.json``.
        shards: each shard's tokens, 1-D read-only ``np.memmap`` of the index's dtype.
        doc_ends: int64 ``[documents]``: each document's end in the concatenated shards.
        buckets, ranks: the documents' split keys (:mod:`tetrad.data.split`).
        counts: int64 ``[vocab_size]``: how often each token id occurs.
    """

    folder: pathlib.Path
    index: dict
    shards: list[np.ndarray]
    doc_ends: np.ndarray
    buckets: np.ndarray
    ranks: np.ndarray
    counts: np.ndarray


def open_prepared(folder: str | os.PathLike) -> Prepared:
    """Memory-map the shards of a complete prepared folder and load its document index.

    Raises:
        DataError: the folder is an unfinished preparation, or a shard is missing or has the
            wrong size (each saying what to do).
    """
    p = pathlib.Path(folder)
    index = read_json(p / INDEX)
    if index is None or index.get("format") != FORMAT:
        raise DataError(
            f"{str(p)!r} is an unfinished preparation (no index.json): run the same "
            "`tetrad prepare` again to finish it"
        )
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    shards, ends, buckets, ranks = [], [], [], []
    counts = np.zeros(index["vocab_size"], np.int64)
    start = 0
    for i, s in enumerate(index["shards"]):
        b = shard_file(p, i, "bin")
        if not b.is_file() or b.stat().st_size != s["tokens"] * dtype.itemsize:
            raise DataError(
                f"shard {b} of {str(p)!r} is missing or has the wrong size: prepare the data "
                "again into an empty folder"
            )
        shards.append(np.memmap(b, dtype=dtype, mode="r"))
        with np.load(shard_file(p, i, "npz")) as z:
            ends.append(z["doc_ends"] + start)
            buckets.append(z["buckets"])
            ranks.append(z["ranks"])
            counts += z["counts"]
        start += s["tokens"]
    cat = np.concatenate
    return Prepared(
        p,
        index,
        shards,
        cat(ends) if ends else np.zeros(0, np.int64),
        cat(buckets) if buckets else np.zeros(0, np.uint16),
        cat(ranks) if ranks else np.zeros(0, np.uint64),
        counts,
    )
