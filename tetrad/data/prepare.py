"""``tetrad prepare``: inputs -> token shards, tokenized in parallel worker processes.

The calling process reads the inputs (:mod:`tetrad.data.readers`) and writes the shards
(:mod:`tetrad.data.shards`); ``workers`` processes tokenize (:mod:`tetrad.data.encode`), each
building its own single-threaded tokenizer (Megatron's pattern; started with ``spawn``, so no
tokenizer thread pool or torch state crosses a fork). At most ``2 * workers`` batches are in
flight, and results are written in input order, so memory is bounded by workers x batch (never
the corpus) and the shards do not depend on ``workers``. ``workers=0`` tokenizes in the calling
process with the tokenizer's own threads.

A preparation is resumable: its ``job.json`` records the inputs (paths, sizes, mtimes), the
tokenizer and the settings; each complete shard records the input cursor after it. Run again
with the same job after a kill, it keeps the complete shards and reads on from the last one's
cursor, giving the shards an uninterrupted run would have written.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import multiprocessing
import os
import pathlib
import shutil
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from tqdm import tqdm

from tetrad.data import shards as sh
from tetrad.data.damaged import drop_damaged
from tetrad.data.encode import Encoded, Settings, encode, init_worker
from tetrad.data.errors import DataError
from tetrad.data.readers import START, Batch, Cursor, batches, kind_of
from tetrad.data.sources import INDEX, JOB, TEXT, Source, find_sources, is_prepared
from tetrad.data.split import path_keys
from tetrad.data.tokenizer import (
    bpe_sample,
    end_token,
    file_sha256,
    load_tokenizer,
    token_dtype,
    train_bpe,
)

ENCODING_ERRORS = ("replace", "strict")


def check_settings(
    val_fraction: float, encoding_errors: str, workers: int, shard_bytes: int, text_field: str
) -> None:
    """Raises DataError for a value :func:`prepare` cannot use (one line naming it)."""
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction {val_fraction} must be between 0 and 1 (exclusive)")
    if encoding_errors not in ENCODING_ERRORS:
        raise DataError(f"encoding_errors {encoding_errors!r} is not replace or strict")
    if workers < 0:
        raise DataError(f"workers {workers} must be 0 (this process) or more")
    if shard_bytes < 1:
        raise DataError(f"shard size {shard_bytes} bytes must be positive")
    if not text_field:
        raise DataError("text_field is empty: name the field that holds the text")


def job_of(
    sources: list[Source],
    tokenizer: str,
    vocab_size: int,
    val_fraction: float,
    text_field: str,
    encoding_errors: str,
    shard_bytes: int,
) -> dict:
    """What a preparation produces from (``job.json``): equal jobs give equal shards."""
    tok = (
        {"sha256": file_sha256(os.path.expanduser(tokenizer))}
        if tokenizer
        else {"bpe_vocab_size": vocab_size, "bpe_val_fraction": val_fraction}
    )
    return {
        "format": sh.FORMAT,
        "version": sh.VERSION,
        "sources": [
            {"path": str(s.path), "format": s.format, "files": s.fingerprint()} for s in sources
        ],
        "tokenizer": tok,
        "text_field": text_field,
        "encoding_errors": encoding_errors,
        "shard_bytes": shard_bytes,
    }


@contextlib.contextmanager
def _locked(folder: pathlib.Path, wait: bool):
    """Hold ``folder/.lock`` (``flock``); without ``wait``, DataError if another process does."""
    with open(folder / ".lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise DataError(
                f"another tetrad prepare is writing {str(folder)!r}: wait for it to finish"
            ) from None
        yield


def _start_job(folder: pathlib.Path, job: dict, tokenizer: str, sources: list[Source]) -> None:
    """Check that ``folder`` is empty or holds this job, then write its tokenizer and
    ``job.json`` (the tokenizer first, trained here when none is given). Another job's files
    are removed if none of its shards was finished.

    Raises:
        DataError: ``folder`` holds another job with a finished shard, or other files.
    """
    old = sh.read_json(folder / JOB)
    if old == job:
        return
    if old is not None:
        if sh.shard_file(folder, 0, "json").is_file():
            raise DataError(
                f"{str(folder)!r} holds an unfinished preparation of other inputs or settings: "
                "pass another --out, or remove it"
            )
        # no shard of that job was finished (it stopped at a mistake, say): start this one
        for name in (JOB, sh.TOKENIZER):
            (folder / name).unlink(missing_ok=True)
        shutil.rmtree(folder / sh.SHARDS, ignore_errors=True)
    others = [p.name for p in folder.iterdir() if p.name not in (".lock", sh.TOKENIZER)]
    if others:
        raise DataError(f"--out {str(folder)!r} is not empty ({others[0]}, ...): pass a new folder")
    if tokenizer:
        tok = load_tokenizer(tokenizer)
    else:
        t = job["tokenizer"]
        texts = bpe_sample(
            sources, t["bpe_val_fraction"], job["text_field"], job["encoding_errors"]
        )
        tok = train_bpe(texts, t["bpe_vocab_size"])
    tok.save(str(folder / sh.TOKENIZER))
    sh.write_json(folder / JOB, job)


def _encoded(
    todo: Iterator[Batch], settings: Settings, tokenizer_json: str, workers: int
) -> Iterator[tuple[Cursor, int, Encoded]]:
    """``(end cursor, input bytes done, tokens)`` of each batch, in input order."""
    if workers == 0:
        init_worker(tokenizer_json, settings, threads=True)
        for b in todo:
            yield b.end, b.done_bytes, encode(b)
        return
    pool = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=init_worker,
        initargs=(tokenizer_json, settings),
    )
    pending: collections.deque = collections.deque()
    try:
        for b in todo:
            pending.append((b.end, b.done_bytes, pool.submit(encode, b)))
            if len(pending) >= 2 * workers:
                end, done, fut = pending.popleft()
                yield end, done, fut.result()
        while pending:
            end, done, fut = pending.popleft()
            yield end, done, fut.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _settings(sources: list[Source], job: dict, tok) -> Settings:
    text = [i for i, s in enumerate(sources) if s.format == TEXT]
    keys: list = [None] * len(sources)
    for i, k in zip(text, path_keys([sources[i].path for i in text]), strict=True):
        keys[i] = k
    return Settings(
        tuple(str(s.path) for s in sources),
        tuple(kind_of(s.format) for s in sources),
        tuple(keys),
        job["text_field"],
        job["encoding_errors"],
        end_token(tok),
        token_dtype(tok.get_vocab_size()),
    )


def _run(
    folder: pathlib.Path, sources: list[Source], job: dict, workers: int, progress: bool
) -> dict:
    """Tokenize from the last complete shard on; write ``index.json``; return it."""
    tok_json = (folder / sh.TOKENIZER).read_text()
    tok = load_tokenizer(folder / sh.TOKENIZER)
    settings = _settings(sources, job, tok)
    itemsize = np.dtype(settings.dtype).itemsize
    done = sh.completed_shards(folder, itemsize)
    cursor = Cursor(*done[-1]["cursor"]) if done else START
    writer = sh.ShardWriter(
        folder,
        len(done),
        settings.dtype,
        tok.get_vocab_size(),
        job["shard_bytes"],
        done[-1]["totals"] if done else {},
    )
    total = sum(s.bytes for s in sources)
    bar = tqdm(
        total=total,
        initial=writer.totals["done_bytes"],
        unit="B",
        unit_scale=True,
        disable=not (progress and sys.stderr.isatty()),
        desc="tetrad prepare",
        dynamic_ncols=True,
    )
    t0 = time.perf_counter()
    with bar:
        for end, done_bytes, enc in _encoded(
            batches(sources, cursor, job["text_field"]), settings, tok_json, workers
        ):
            writer.add(enc, end, done_bytes)
            bar.update(done_bytes - bar.n)
            t = writer.totals
            bar.set_postfix_str(f"{t['documents']:,} docs, {t['tokens']:,} tokens", refresh=False)
        writer.finish(Cursor(len(sources), 0, 0))
    t = writer.totals
    if not t["tokens"]:
        raise DataError(
            f"--data holds no text: {t['empty_documents']:,} empty document(s) in "
            f"{len(sources)} input(s)"
        )
    markers = sh.completed_shards(folder, itemsize)
    index = {
        "format": sh.FORMAT,
        "version": sh.VERSION,
        "job": job,
        "dtype": settings.dtype,
        "vocab_size": tok.get_vocab_size(),
        "eot": settings.eot,
        "tokenizer_sha256": file_sha256(folder / sh.TOKENIZER),
        "shards": [{"tokens": m["tokens"], "documents": m["documents"]} for m in markers],
        "files": sum(len(s.files) for s in sources),
        "bytes": total,
        "seconds": time.perf_counter() - t0,
    } | {k: t[k] for k in sh.TOTALS if k != "done_bytes"}
    sh.write_json(folder / INDEX, index)
    return index


def prepare_sources(
    sources: list[Source],
    folder: pathlib.Path,
    job: dict,
    tokenizer: str = "",
    *,
    workers: int = 0,
    progress: bool = False,
    wait: bool = False,
) -> tuple[dict, bool]:
    """:func:`prepare` for sources already found and their :func:`job_of`; returns the index
    and whether this call wrote it (False: ``folder`` was complete already).

    Raises:
        DataError: as :func:`prepare`; ``folder`` is a file or cannot be created.
    """
    _make_folder(folder)
    with _locked(folder, wait):
        index = sh.read_json(folder / INDEX)
        if index is not None:
            if index.get("job") == job:
                return index, False
            raise DataError(
                f"{str(folder)!r} holds data prepared from other inputs or settings: pass "
                "another --out, or remove it"
            )
        _start_job(folder, job, tokenizer, sources)
        return _run(folder, sources, job, workers, progress), True


def _make_folder(folder: pathlib.Path) -> None:
    """Create the ``--out`` folder (and its parents) if needed.

    Raises:
        DataError: it, or a parent, is a file, or it cannot be created.
    """
    if folder.exists() and not folder.is_dir():
        raise DataError(f"--out {str(folder)!r} is a file: pass a folder (new, or empty)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(
            f"cannot create --out {str(folder)!r} ({e.strerror}): pass another folder"
        ) from None


def prepare(
    inputs: list[str],
    out: str | os.PathLike,
    tokenizer: str = "",
    *,
    vocab_size: int = 4096,
    val_fraction: float = 0.01,
    text_field: str = "text",
    encoding_errors: str = "replace",
    workers: int = 0,
    shard_bytes: int = sh.SHARD_BYTES,
    progress: bool = False,
    skip_bad_files: bool = False,
) -> dict:
    """Tokenize ``inputs`` (``--data`` entries, :func:`tetrad.data.sources.find_sources`;
    empty: the Python standard library) into the prepared folder ``out``
    (:mod:`tetrad.data.shards`); returns its ``index.json``.

    ``tokenizer``: a ``tokenizer.json``; empty: a byte-level BPE of ``vocab_size`` ids is
    trained on at most 8 MB of train documents (``val_fraction`` says which are held out; see
    :func:`tetrad.data.tokenizer.bpe_sample`). ``workers``: tokenizing processes (0: this
    process). ``shard_bytes``: shard size, bytes. ``progress``: a tqdm bar on stderr when it
    is a terminal (input bytes, MB/s, ETA, documents and tokens). ``skip_bad_files``: leave
    out damaged inputs (:mod:`tetrad.data.damaged`) instead of stopping at the first. A
    complete ``out`` of the same job is returned as is; an unfinished one is resumed.

    Raises:
        DataError: bad inputs (:func:`~tetrad.data.sources.find_sources`), settings
            (:func:`check_settings`) or tokenizer; ``out`` not empty and not this job's, or
            being prepared by another process; bad data (:func:`tetrad.data.encode.encode`);
            inputs without any text.
    """
    sources, job = plan_job(
        inputs,
        tokenizer,
        vocab_size,
        val_fraction,
        text_field,
        encoding_errors,
        workers,
        shard_bytes,
        skip_bad_files,
    )
    folder = pathlib.Path(os.path.expanduser(str(out)))
    return prepare_sources(sources, folder, job, tokenizer, workers=workers, progress=progress)[0]


def plan_job(
    inputs: list[str],
    tokenizer: str,
    vocab_size: int,
    val_fraction: float,
    text_field: str,
    encoding_errors: str,
    workers: int,
    shard_bytes: int,
    skip_bad_files: bool = False,
) -> tuple[list[Source], dict]:
    """The sources of ``inputs`` and the :func:`job_of` a preparation of them, after checking
    the settings; with ``skip_bad_files`` without the damaged ones
    (:func:`tetrad.data.damaged.drop_damaged`, which reads the compressed and Parquet inputs
    through), listed in the job's ``skipped``.

    Raises:
        DataError: as :func:`prepare`, before anything is written (and, without
            ``skip_bad_files``, read).
    """
    check_settings(val_fraction, encoding_errors, workers, shard_bytes, text_field)
    for p in inputs:
        if is_prepared(os.path.expanduser(p)):
            raise DataError(
                f"{p!r} is a prepared folder: pass it alone to --data, not with other inputs"
            )
    sources = find_sources(inputs)
    skipped: list[str] = []
    if skip_bad_files:
        sources, skipped = drop_damaged(sources, text_field)
    if not tokenizer and vocab_size < 257:
        raise DataError(f"vocab_size {vocab_size} is too small: byte-level BPE needs >= 257")
    if tokenizer:
        load_tokenizer(tokenizer)  # exists and parses
    job = job_of(
        sources, tokenizer, vocab_size, val_fraction, text_field, encoding_errors, shard_bytes
    )
    if skipped:
        job["skipped"] = skipped  # the shards are those of the other inputs
    return sources, job


def summary_line(index: dict, folder: str | os.PathLike) -> str:
    """One line saying what a preparation did (and what it skipped or replaced)."""
    s = max(index["seconds"], 1e-9)
    line = (
        f"tetrad: prepared {index['documents']:,} documents ({index['tokens']:,} tokens) from "
        f"{index['files']:,} file(s), {index['bytes'] / 1e6:,.1f} MB, in {s:.1f} s "
        f"({index['tokens'] / s:,.0f} tokens/s) into {folder}"
    )
    skipped = index.get("job", {}).get("skipped", [])
    if skipped:
        line += f"; left out {len(skipped)} damaged file(s): {', '.join(skipped)}"
    if index["empty_documents"]:
        line += f"; skipped {index['empty_documents']:,} empty document(s)"
    if index["non_utf8_documents"]:
        line += (
            f"; replaced {index['non_utf8_bytes']:,} non-UTF-8 byte(s) in "
            f"{index['non_utf8_documents']:,} document(s) by U+FFFD"
        )
    return line
