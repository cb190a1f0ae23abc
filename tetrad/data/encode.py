"""Raw documents -> text -> token ids: what each tokenizing worker process does to a batch.

A worker is started with :func:`init_worker` (it builds its own tokenizer from the JSON text,
single-threaded: ``TOKENIZERS_PARALLELISM=false``, the safe pattern after a fork or spawn) and
runs :func:`encode` on :class:`~tetrad.data.readers.Batch` es. The same functions run in the
calling process when there are no workers (the tokenizer then uses its own threads).

Decoding: UTF-8; with ``encoding_errors="replace"`` invalid bytes become U+FFFD and are counted,
with ``"strict"`` the first one stops the preparation with the file and byte offset. A JSONL
line must be a JSON object holding the text field (a string, or null: empty). Empty documents
are skipped and counted: they add no token, not even the end token.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import signal
import threading
import time

import numpy as np

from tetrad.data.errors import DataError
from tetrad.data.readers import Batch, Doc
from tetrad.data.split import content_key

_ESCAPED = re.compile("[\udc80-\udcff]")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every batch of a preparation is encoded with.

    Attributes:
        names: each source's path (for messages); ``kinds``: each source's reader kind,
            ``text``, ``jsonl`` or ``column`` (Parquet, ``datasets``).
        text_keys: each source's ``(bucket, rank)`` split key for text sources (their
            documents are whole files, keyed by path), None for the others (keyed by content).
        text_field: the JSON field holding the document.
        encoding_errors: ``replace`` or ``strict``.
        eot: id of the end-of-document token appended to each document.
        dtype: numpy name of the token dtype (``uint16`` or ``uint32``).
    """

    names: tuple[str, ...]
    kinds: tuple[str, ...]
    text_keys: tuple
    text_field: str
    encoding_errors: str
    eot: int
    dtype: str


@dataclasses.dataclass
class Encoded:
    """The tokens of one batch.

    Attributes:
        tokens: 1-D token ids, each finished document followed by the end token.
        doc_ends: int64 ``[documents]``: where each document finished in this batch ends in
            ``tokens`` (exclusive, after its end token).
        buckets, ranks: uint16 and uint64 ``[documents]``: their split keys
            (:mod:`tetrad.data.split`).
        empty: empty documents skipped; ``non_utf8_documents``/``non_utf8_bytes``: documents
            with invalid UTF-8 and their invalid bytes (replaced by U+FFFD);
            ``text_bytes``: UTF-8 bytes of the text tokenized.
    """

    tokens: np.ndarray
    doc_ends: np.ndarray
    buckets: np.ndarray
    ranks: np.ndarray
    empty: int = 0
    non_utf8_documents: int = 0
    non_utf8_bytes: int = 0
    text_bytes: int = 0


_worker: dict = {}


def _exit_with(parent: int) -> None:
    """Leave as soon as ``parent`` is gone (a killed preparation must not leave its workers
    waiting forever on a queue that the worker itself holds open)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def init_worker(tokenizer_json: str, settings: Settings, threads: bool = False) -> None:
    """Build this process's tokenizer from ``tokenizer.json`` text. ``threads=False`` (a
    worker process): one tokenizer thread, Ctrl-C and SIGTERM ignored (the parent stops the
    pool and says so), and the process exits when its parent dies."""
    if not threads:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    from tokenizers import Tokenizer

    _worker["tok"] = Tokenizer.from_str(tokenizer_json)
    _worker["settings"] = settings


def _where(s: Settings, doc: Doc, at: int) -> str:
    """``file 'X' line N (byte B)`` naming where a problem is (``at``: offset in the payload)."""
    where = f"data file {s.names[doc.source]!r}"
    if s.kinds[doc.source] == "text":
        return f"{where} at byte {doc.offset + at}"
    if s.kinds[doc.source] == "jsonl":
        return f"{where} line {doc.number} (byte {doc.offset + at})"
    return f"{where} row {doc.number} (byte {at} of its text)"


def _decode(s: Settings, doc: Doc, raw: bytes, out: Encoded) -> str:
    """``raw`` as UTF-8 under the settings' policy, counting replacements into ``out``."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if s.encoding_errors == "strict":
            raise DataError(
                f"{_where(s, doc, e.start)} is not UTF-8 ({raw[e.start : e.start + 4]!r}...): "
                "fix the file, or pass --encoding-errors replace"
            ) from None
    out.non_utf8_documents += 1
    out.non_utf8_bytes += len(_ESCAPED.findall(raw.decode("utf-8", "surrogateescape")))
    return raw.decode("utf-8", "replace")


def _record_text(s: Settings, doc: Doc, out: Encoded) -> str:
    """The text of a JSONL line or a column value (empty for null)."""
    if doc.payload is None:
        return ""
    text = _decode(s, doc, doc.payload, out)
    if s.kinds[doc.source] == "column":
        return text
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise DataError(f"{_where(s, doc, 0)} is not JSON ({e}): fix or remove it") from None
    if not isinstance(obj, dict):
        raise DataError(f"{_where(s, doc, 0)} is a JSON {type(obj).__name__}, not an object")
    if s.text_field not in obj:
        fields = ", ".join(obj) or "none"
        raise DataError(
            f"{_where(s, doc, 0)} has no field {s.text_field!r} (fields: {fields}): pass "
            "--text-field NAME"
        )
    value = obj[s.text_field]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(
            f"{_where(s, doc, 0)}: field {s.text_field!r} is a JSON {type(value).__name__}, "
            "not a string: pass --text-field NAME of the text"
        )
    return value


def _utf8(s: Settings, doc: Doc, text: str, out: Encoded) -> tuple[str, bytes]:
    """``text`` and its UTF-8 bytes; lone surrogates (from JSON escapes) count as invalid."""
    try:
        return text, text.encode("utf-8")
    except UnicodeEncodeError as e:
        if s.encoding_errors == "strict":
            raise DataError(
                f"{_where(s, doc, 0)} holds an unpaired surrogate (U+{ord(text[e.start]):04X}): "
                "fix it, or pass --encoding-errors replace"
            ) from None
        data = text.encode("utf-8", "replace")
        out.non_utf8_documents += 1
        out.non_utf8_bytes += sum(1 for c in text if "\ud800" <= c <= "\udfff")
        return data.decode("utf-8"), data


def _texts(batch: Batch, s: Settings, out: Encoded) -> tuple[list[str], list[bool], list]:
    """The texts to tokenize (empty documents dropped and counted), whether each ends its
    document, and the split keys of those that do."""
    texts, ends, keys = [], [], []
    for doc in batch.docs:
        if s.kinds[doc.source] == "text":
            text, key = _decode(s, doc, doc.payload, out), s.text_keys[doc.source]
            out.text_bytes += len(doc.payload)
        else:
            text, data = _utf8(s, doc, _record_text(s, doc, out), out)
            key = content_key(data)
            out.text_bytes += len(data)
        if not text:  # only a whole text file can be empty, never one of its pieces
            out.empty += 1
            continue
        texts.append(text)
        ends.append(doc.ends_doc)
        if doc.ends_doc:
            keys.append(key)
    return texts, ends, keys


def encode(batch: Batch) -> Encoded:
    """Tokenize ``batch`` with this process's tokenizer (:func:`init_worker`).

    Raises:
        DataError: invalid UTF-8 with ``encoding_errors="strict"``, a JSONL line that is not a
            JSON object, lacks the text field (naming the fields present) or holds a non-string
            there (each naming the file, line and byte offset).
    """
    s: Settings = _worker["settings"]
    out = Encoded(*(np.zeros(0, t) for t in (s.dtype, np.int64, np.uint16, np.uint64)))
    texts, ends, keys = _texts(batch, s, out)
    encodings = _worker["tok"].encode_batch_fast(texts, add_special_tokens=False)
    ids = [e.ids for e in encodings]
    lengths = np.array([len(i) + end for i, end in zip(ids, ends, strict=True)], np.int64)
    for i, end in zip(ids, ends, strict=True):
        if end:
            i.append(s.eot)
    out.tokens = np.fromiter(itertools.chain.from_iterable(ids), s.dtype, int(lengths.sum()))
    out.doc_ends = np.cumsum(lengths)[np.array(ends, dtype=bool)]
    out.buckets = np.array([k[0] for k in keys], np.uint16)
    out.ranks = np.array([k[1] for k in keys], np.uint64)
    return out


def record_texts(batch: Batch, s: Settings) -> list[tuple[str, tuple[int, int]]]:
    """The non-empty documents of a batch of records (no text source) with their split keys:
    what the BPE is trained on before any token exists.

    Raises:
        DataError: as :func:`encode`.
    """
    out = Encoded(*(np.zeros(0) for _ in range(4)))
    texts, _, keys = _texts(batch, s, out)
    return list(zip(texts, keys, strict=True))
