"""What ``tetrad train`` trains on: a prepared folder, or ``--data`` prepared into the cache.

``--data DIR`` naming a folder written by ``tetrad prepare`` is used as is (its tokenizer must
be the run's when ``--tokenizer`` is given). Other ``--data`` entries are prepared once into
``<cache>/<key>/`` (cache: ``cache_dir``, ``$TETRAD_CACHE`` or ``~/.cache/tetrad``; key: the
inputs' paths, sizes and mtimes, the tokenizer's SHA-256 or the BPE's settings, the text field
and the UTF-8 policy), a prepared folder like any other, resumed if a run was killed while
preparing it. Either way the train/validation split is made when loading
(:mod:`tetrad.data.split`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib

import numpy as np

from tetrad.data.errors import DataError
from tetrad.data.loader import TokenStream
from tetrad.data.prepare import plan_job, prepare_sources, summary_line
from tetrad.data.shards import SHARD_BYTES, TOKENIZER, open_prepared
from tetrad.data.sources import is_prepared
from tetrad.data.split import held_out, token_ranges
from tetrad.data.tokenizer import file_sha256


@dataclasses.dataclass
class Corpus:
    """A tokenized corpus, split: the train and validation documents as token streams
    (:class:`~tetrad.data.loader.TokenStream` over the memory-mapped shards, uint16 or uint32
    ids, each document followed by its end token).

    ``unigram_entropy`` is the entropy of the train token frequencies in nats (``-sum p ln p``):
    the loss of a model that only learned token frequencies. ``n_files``/``n_bytes``: the input
    files and their size on disk (bytes); ``n_documents``: documents tokenized (empty ones
    skipped); ``folder``: the prepared folder.
    """

    train: TokenStream
    val: TokenStream
    vocab_size: int
    tokenizer_path: pathlib.Path
    unigram_entropy: float
    n_files: int
    n_bytes: int
    n_documents: int
    folder: pathlib.Path


def _entropy(counts: np.ndarray) -> float:
    counts = counts.astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def open_corpus(
    folder: str | os.PathLike, val_fraction: float = 0.01, tokenizer: str = ""
) -> Corpus:
    """The corpus of the prepared ``folder``, its documents split for ``val_fraction``
    (:func:`tetrad.data.split.held_out`; one document: its last tokens).

    Raises:
        DataError: ``val_fraction`` outside (0, 1), an unfinished or damaged folder, or a
            ``tokenizer`` (a ``tokenizer.json`` path; empty: no check) other than the folder's.
    """
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction {val_fraction} must be between 0 and 1 (exclusive)")
    prep = open_prepared(folder)
    idx = prep.index
    if tokenizer:
        path = os.path.expanduser(tokenizer)
        if not os.path.isfile(path):
            raise DataError(f"tokenizer {tokenizer!r} does not exist: pass a tokenizer.json file")
        if file_sha256(path) != idx["tokenizer_sha256"]:
            raise DataError(
                f"--data {str(folder)!r} was prepared with another tokenizer than {tokenizer!r} "
                f"(SHA-256 {idx['tokenizer_sha256'][:12]}... vs {file_sha256(path)[:12]}...): "
                "prepare the data again with this --tokenizer, or train with the folder's"
            )
    is_val = held_out(prep.buckets, prep.ranks, val_fraction)
    train_ranges, val_ranges = token_ranges(prep.doc_ends, is_val, val_fraction)
    val = TokenStream(prep.shards, val_ranges)
    counts = prep.counts - val.bincount(idx["vocab_size"])
    return Corpus(
        train=TokenStream(prep.shards, train_ranges),
        val=val,
        vocab_size=idx["vocab_size"],
        tokenizer_path=prep.folder / TOKENIZER,
        unigram_entropy=_entropy(counts),
        n_files=idx["files"],
        n_bytes=idx["bytes"],
        n_documents=idx["documents"],
        folder=prep.folder,
    )


def prepared_folder(paths: list[str]) -> pathlib.Path | None:
    """The folder when ``paths`` is one prepared folder, else None."""
    if len(paths) == 1 and is_prepared(os.path.expanduser(paths[0])):
        return pathlib.Path(os.path.expanduser(paths[0]))
    return None


def prepare_corpus(
    paths: list[str],
    tokenizer: str = "",
    vocab_size: int = 4096,
    val_fraction: float = 0.01,
    cache_dir: str | os.PathLike | None = None,
    *,
    text_field: str = "text",
    encoding_errors: str = "replace",
    workers: int = 0,
    progress: bool = False,
    skip_bad_files: bool = False,
) -> Corpus:
    """The corpus of ``--data`` ``paths``: a prepared folder opened as is, or the inputs
    prepared into the cache first (see the module docstring; a cache hit only memory-maps the
    shards). Preparing prints :func:`~tetrad.data.prepare.summary_line`.

    ``tokenizer`` empty: a byte-level BPE of ``vocab_size`` ids trained on the train documents
    (``<|endoftext|>`` = id 0); else a HF ``tokenizer.json``. ``workers``: tokenizing
    processes (0: this process); ``progress``: a progress bar on stderr; ``skip_bad_files``:
    leave out damaged inputs (:mod:`tetrad.data.damaged`; they are read through at every call).

    Raises:
        DataError: missing, empty or binary inputs (:func:`tetrad.data.sources.find_sources`),
            bad settings or data (:func:`tetrad.data.prepare.prepare`), or as
            :func:`open_corpus`.
    """
    folder = prepared_folder(paths)
    if folder is not None:
        return open_corpus(folder, val_fraction, tokenizer)
    sources, job = plan_job(
        paths,
        tokenizer,
        vocab_size,
        val_fraction,
        text_field,
        encoding_errors,
        workers,
        SHARD_BYTES,
        skip_bad_files,
    )
    key = hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()[:16]
    cache = pathlib.Path(cache_dir or os.environ.get("TETRAD_CACHE") or "~/.cache/tetrad")
    entry = cache.expanduser() / key
    index, wrote = prepare_sources(
        sources, entry, job, tokenizer, workers=workers, progress=progress, wait=True
    )
    if wrote:
        print(summary_line(index, entry), flush=True)
    return open_corpus(entry, val_fraction)
