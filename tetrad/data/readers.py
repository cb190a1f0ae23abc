"""Each input format streamed as raw documents, grouped into batches that say where they end.

Nothing here decodes or tokenizes (the workers do, :mod:`tetrad.data.encode`): a reader yields
each document's bytes (a text file whole, or in pieces of about :data:`PIECE_BYTES` for a large
one; a JSONL line; a Parquet or ``datasets`` value), and :func:`batches` groups consecutive
documents (across sources) until :data:`BATCH_BYTES` or :data:`BATCH_DOCS`. Each batch records the
:class:`Cursor` after it. Batches depend only on the cursor they start from, so a preparation
resumed at a batch's end cursor reads exactly the batches an uninterrupted one would have read.

Libraries: ``gzip`` (standard library) and ``zstandard`` (multi-frame files, frame by frame) for
compressed JSONL, ``pyarrow.parquet`` for Parquet (streamed by record batches), ``datasets``
for ``save_to_disk`` folders (memory-mapped Arrow). Memory holds one batch at a time.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
from collections.abc import Iterator
from typing import NamedTuple

from tetrad.data.errors import DataError
from tetrad.data.sources import DATASETS, JSONL, JSONL_GZ, JSONL_ZST, PARQUET, TEXT, Source

BATCH_BYTES = 1 << 20  # a batch holds about 1 MiB of documents ...
BATCH_DOCS = 1024  # ... or at most this many
PIECE_BYTES = 4 << 20  # a text file above this is read in pieces of about this size
ROWS = 1024  # rows read at once from Parquet and datasets
BOM = b"\xef\xbb\xbf"
WHITESPACE = b" \t\n\r\x0b\x0c"


SKIP_HINT = " (or pass --skip-bad-files to leave damaged files out)"


class DamagedFileError(DataError):
    """An input that cannot be read to its end (cut short or corrupt): one line naming it."""


class Cursor(NamedTuple):
    """A position in the inputs: source index, documents (lines, rows, pieces) read in that
    source, and the byte offset reached in it (in the decompressed stream for ``.gz``/``.zst``;
    0 for Parquet and ``datasets``)."""

    source: int
    item: int
    offset: int


START = Cursor(0, 0, 0)


class Doc(NamedTuple):
    """One raw document (or piece of a large text file) in a :class:`Batch`.

    Attributes:
        source: index of its source.
        payload: the raw bytes (None for a null value).
        number: its 1-based line (JSONL), row (Parquet, ``datasets``) or piece (text) number.
        offset: byte offset of its start (decompressed; 0 for rows), for messages.
        ends_doc: False for a piece of a large text file that is not its last.
    """

    source: int
    payload: bytes | None
    number: int
    offset: int
    ends_doc: bool


@dataclasses.dataclass
class Batch:
    """Consecutive raw documents, possibly of several sources.

    Attributes:
        docs: the documents, in input order.
        end: the cursor after this batch.
        done_bytes: input bytes on disk consumed at the end of this batch, all sources.
    """

    docs: list[Doc]
    end: Cursor
    done_bytes: int


class _Item(NamedTuple):
    payload: bytes | None
    number: int  # 1-based line/row/piece number of this item
    offset: int  # byte offset of its start
    next_offset: int  # byte offset after it
    disk: int  # bytes of the file on disk consumed after it
    ends_doc: bool


def _cut(chunk: bytes) -> int:
    """Where to end a text piece inside ``chunk``: after its last newline that is followed by a
    non-whitespace byte (a cut there changes no byte-level BPE pre-token), or 0 if none."""
    i = len(chunk) - 1
    while True:
        i = chunk.rfind(b"\n", 0, i)
        if i < 0:
            return 0
        if chunk[i + 1] not in WHITESPACE:
            return i + 1


def text_pieces(path, item: int, offset: int) -> Iterator[_Item]:
    """A text file from byte ``offset`` on (``item`` pieces already read): one item, or above
    :data:`PIECE_BYTES` pieces cut by :func:`_cut`."""
    with open(path, "rb") as f:
        size = f.seek(0, io.SEEK_END)
        f.seek(offset)
        if offset == 0 and size <= PIECE_BYTES:
            yield _Item(f.read(), 1, 0, size, size, True)
            return
        while offset < size:
            chunk, want = f.read(PIECE_BYTES), PIECE_BYTES
            while len(chunk) >= want and not (n := _cut(chunk)):  # one long line: read on
                more = f.read(want)
                chunk, want = chunk + more, 2 * want
            n = len(chunk) if offset + len(chunk) >= size else _cut(chunk)
            f.seek(offset + n)
            item += 1
            yield _Item(chunk[:n], item, offset, offset + n, offset + n, offset + n >= size)
            offset += n


def _open_jsonl(path, fmt: str, raw) -> io.BufferedReader:
    if fmt == JSONL_GZ:
        return io.BufferedReader(gzip.GzipFile(fileobj=raw, mode="rb"), 1 << 20)
    if fmt == JSONL_ZST:
        return io.BufferedReader(ZstdFrames(raw), 1 << 20)
    return io.BufferedReader(raw, 1 << 20)


class ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a zstd stream of one or more frames, read from ``raw``.

    zstandard's ``stream_reader`` ends quietly where a cut file ends, inside a frame (a file cut
    in its only frame reads as empty); this reader decompresses frame by frame
    (``ZstdDecompressor.decompressobj``, whose ``eof`` says a frame is complete) and raises
    :class:`EOFError` when the input ends inside one, as ``gzip`` does.
    """

    def __init__(self, raw: io.RawIOBase | io.BufferedIOBase):
        import zstandard

        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor(max_window_size=1 << 31)
        self._frame = None  # the decompressor of the frame being read
        self._fed = False  # whether that frame has been given input
        self._out, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        """Fill ``buffer`` with decompressed bytes; 0 at the end of the stream.

        Raises:
            EOFError: the input ends inside a frame (the file was cut short).
            zstandard.ZstdError: the input is not zstd data, or is damaged.
        """
        while self._pos >= len(self._out):
            chunk = self._raw.read(1 << 20)
            if not chunk:
                if self._fed and not self._frame.eof:
                    raise EOFError("it ends inside a zstd frame: the file was cut short")
                return 0
            self._out, self._pos = self._decompress(chunk), 0
        n = min(len(buffer), len(self._out) - self._pos)
        buffer[:n] = self._out[self._pos : self._pos + n]
        self._pos += n
        return n

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            if self._frame is None or self._frame.eof:
                self._frame, self._fed = self._dctx.decompressobj(), False
            out.append(self._frame.decompress(data))
            self._fed = True
            data = self._frame.unused_data if self._frame.eof else b""
        return b"".join(out)


def _skip(stream, fmt: str, offset: int) -> None:
    """Move ``stream`` to decompressed byte ``offset`` (plain files seek; others read on)."""
    if fmt == JSONL:
        stream.seek(offset)
        return
    left = offset
    while left:
        got = len(stream.read(min(left, 1 << 24)))
        if not got:
            break
        left -= got


def _jsonl_items(src: Source, item: int, offset: int) -> Iterator[_Item]:
    """The non-blank lines of a JSONL file (a UTF-8 byte-order mark at its start dropped)."""
    with open(src.path, "rb") as raw:
        stream = _open_jsonl(src.path, src.format, raw)
        _skip(stream, src.format, offset)
        try:
            for line in stream:
                start, offset, item = offset, offset + len(line), item + 1
                if start == 0 and line.startswith(BOM):
                    line = line[len(BOM) :]
                if line.strip():
                    yield _Item(line, item, start, offset, raw.tell(), True)
        except Exception as e:  # gzip/zstd: a damaged or cut file (OSError, EOFError, ZstdError)
            raise DamagedFileError(
                f"data file {str(src.path)!r} is damaged after line {item} ({e}): "
                f"compress it again or remove it{SKIP_HINT}"
            ) from None


def _check_field(src: Source, names: list[str], field: str) -> None:
    if field not in names:
        raise DataError(
            f"data file {str(src.path)!r} has no field {field!r} (fields: {', '.join(names)}): "
            "pass --text-field NAME"
        )


def _column_values(table, src: Source, field: str) -> list:
    """The ``field`` column of an Arrow table as bytes (None for nulls), unvalidated UTF-8."""
    import pyarrow as pa

    col = table.column(field)
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        if not (pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type)):
            raise DataError(
                f"field {field!r} of {str(src.path)!r} holds {col.type}, not text: pass "
                "--text-field NAME of a string column"
            )
    return col.cast(pa.large_binary()).to_pylist()


def _parquet_items(src: Source, field: str, row: int) -> Iterator[_Item]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(src.path)
    except Exception as e:  # pyarrow.ArrowInvalid and friends
        raise DamagedFileError(
            f"data file {str(src.path)!r} is not Parquet, or was cut short ({e}): write it "
            f"again or remove it{SKIP_HINT}"
        ) from None
    _check_field(src, pf.schema_arrow.names, field)
    meta, size = pf.metadata, src.bytes
    first, group = 0, 0
    while group < meta.num_row_groups and first + meta.row_group(group).num_rows <= row:
        first += meta.row_group(group).num_rows
        group += 1
    total = max(meta.num_rows, 1)
    groups = list(range(group, meta.num_row_groups))
    read = pf.iter_batches(batch_size=ROWS, row_groups=groups, columns=[field])
    while True:
        try:
            batch = next(read, None)
        except Exception as e:  # a corrupt page: pyarrow.ArrowInvalid, OSError
            raise DamagedFileError(
                f"data file {str(src.path)!r} is damaged after row {first} ({e}): write it "
                f"again or remove it{SKIP_HINT}"
            ) from None
        if batch is None:
            return
        for value in _column_values(batch, src, field):
            first += 1
            if first > row:
                yield _Item(value, first, 0, 0, size * first // total, True)


def _datasets_items(src: Source, field: str, row: int) -> Iterator[_Item]:
    import datasets

    datasets.disable_progress_bars()
    ds = datasets.load_from_disk(str(src.path))
    _check_field(src, list(ds.column_names), field)
    table, n, size = ds.with_format("arrow"), len(ds), src.bytes
    for start in range(row, n, ROWS):
        values = _column_values(table[start : start + ROWS], src, field)
        for i, value in enumerate(values, start + 1):
            yield _Item(value, i, 0, 0, size * i // max(n, 1), True)


def _items(src: Source, field: str, item: int, offset: int) -> Iterator[_Item]:
    if src.format == TEXT:
        return text_pieces(src.path, item, offset)
    if src.format in (JSONL, JSONL_GZ, JSONL_ZST):
        return _jsonl_items(src, item, offset)
    if src.format == PARQUET:
        return _parquet_items(src, field, item)
    if src.format == DATASETS:
        return _datasets_items(src, field, item)
    raise AssertionError(src.format)


def read_to_end(src: Source, field: str) -> None:
    """Read ``src`` through (its ``field`` values for records), keeping nothing.

    Raises:
        DamagedFileError: it is cut short or corrupt.
        DataError: a record source without ``field``, a column that is not text.
    """
    for _ in _items(src, field, 0, 0):
        pass


def kind_of(fmt: str) -> str:
    """How a worker reads a document of format ``fmt``: ``text`` (file contents or pieces),
    ``jsonl`` (lines) or ``column`` (Parquet and ``datasets`` values)."""
    return {TEXT: "text", PARQUET: "column", DATASETS: "column"}.get(fmt, "jsonl")


def batches(sources: list[Source], start: Cursor, field: str) -> Iterator[Batch]:
    """The batches of ``sources`` from cursor ``start`` on (see the module docstring).

    Raises:
        DataError: a Parquet or ``datasets`` source without the ``field`` column (naming the
            fields present), a column that is not text, a damaged compressed file.
    """
    done = sum(s.bytes for s in sources[: start.source])
    cur, size = Batch([], start, done), 0
    for si in range(start.source, len(sources)):
        src = sources[si]
        item, offset = (start.item, start.offset) if si == start.source else (0, 0)
        for it in _items(src, field, item, offset):
            cur.docs.append(Doc(si, it.payload, it.number, it.offset, it.ends_doc))
            size += len(it.payload or b"")
            if size >= BATCH_BYTES or len(cur.docs) >= BATCH_DOCS:
                cur.end, cur.done_bytes = Cursor(si, it.number, it.next_offset), done + it.disk
                yield cur
                cur, size = Batch([], cur.end, cur.done_bytes), 0
        done += src.bytes
    if cur.docs:
        cur.end, cur.done_bytes = Cursor(len(sources), 0, 0), done
        yield cur
