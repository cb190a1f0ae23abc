"""The train/validation split: which documents are held out, decided by a hash of each document.

Each document has a key: the SHA-256 of its path relative to the text files' common folder for
a text file (so the split does not depend on where the corpus lives), of its UTF-8 text for a
record (JSONL line, Parquet or ``datasets`` row: the same documents in any of these formats get
the same split, and duplicates fall on the same side). A prepared folder stores each document's
``bucket`` (the 256-bit digest as an integer, ``% 10_000``) and ``rank`` (its top 64 bits, which
order documents as the full digest does); the split is computed when the folder is loaded, so a
prepared folder serves any ``val_fraction``.
"""

from __future__ import annotations

import hashlib
import os
import pathlib

import numpy as np

BUCKETS = 10_000


def digest_key(digest: bytes) -> tuple[int, int]:
    """``(bucket, rank)`` of a SHA-256 ``digest``: the digest as a big-endian integer
    ``% 10_000``, and its top 64 bits."""
    h = int.from_bytes(digest, "big")
    return h % BUCKETS, h >> (8 * len(digest) - 64)


def content_key(data: bytes) -> tuple[int, int]:
    """``(bucket, rank)`` of a record's UTF-8 text ``data``."""
    return digest_key(hashlib.sha256(data).digest())


def path_keys(paths: list[pathlib.Path]) -> list[tuple[int, int]]:
    """``(bucket, rank)`` of each text file, from its path relative to the files' common folder
    (``/``-separated)."""
    if not paths:
        return []
    root = os.path.commonpath([str(p.parent) for p in paths])
    rel = [os.path.relpath(p, root).replace(os.sep, "/") for p in paths]
    return [digest_key(hashlib.sha256(r.encode()).digest()) for r in rel]


def held_out(buckets: np.ndarray, ranks: np.ndarray, val_fraction: float) -> np.ndarray:
    """Which documents are validation documents: bool ``[n_documents]``.

    A document is held out when ``bucket < val_fraction * 10_000``; with two or more documents
    at least one lies on each side (the lowest-rank document is held out if none was, the
    highest-rank one kept for training if all were). One document: all train (the caller splits
    its tokens instead: :func:`token_ranges`).
    """
    n = len(buckets)
    if n <= 1:
        return np.zeros(n, dtype=bool)
    is_val = np.asarray(buckets) < val_fraction * BUCKETS
    if not is_val.any():
        is_val[int(np.argmin(ranks))] = True
    if is_val.all():
        is_val[int(np.argmax(ranks))] = False
    return is_val


def _runs(starts: np.ndarray, ends: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """``[n, 2]`` int64 ``[start, end)`` token ranges of the documents where ``keep``, adjacent
    ones merged."""
    s, e = starts[keep], ends[keep]
    if not len(s):
        return np.zeros((0, 2), dtype=np.int64)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] != e[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(s)) - 1
    return np.stack([s[first], e[last]], axis=1).astype(np.int64)


def token_ranges(
    doc_ends: np.ndarray, is_val: np.ndarray, val_fraction: float
) -> tuple[np.ndarray, np.ndarray]:
    """The train and validation token ranges, each ``[n, 2]`` int64 ``[start, end)`` in the
    prepared token stream, in stream order.

    ``doc_ends``: each document's end (exclusive, after its end token); ``is_val``: from
    :func:`held_out`. One document: its last ``max(1, round(tokens * val_fraction))`` tokens are
    the validation set (a single ``input.txt``).
    """
    ends = np.asarray(doc_ends, dtype=np.int64)
    if len(ends) == 1:
        n = int(ends[0])
        n_val = max(1, round(n * val_fraction))
        return np.array([[0, n - n_val]], np.int64), np.array([[n - n_val, n]], np.int64)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    return _runs(starts, ends, ~is_val), _runs(starts, ends, is_val)
