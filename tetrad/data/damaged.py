"""Inputs that cannot be read to their end, found before tokenizing (``--skip-bad-files``).

Without ``--skip-bad-files`` a damaged input stops the preparation where it is reached, naming
it (:mod:`tetrad.data.readers`). With it, :func:`drop_damaged` reads each compressed JSONL
file to its end (the whole decompression: a cut or corrupt ``.gz`` or ``.zst``) and opens each
Parquet file (its footer: a cut one has none) before anything is tokenized, and leaves out the
damaged ones, so the shards are those of the readable inputs alone, the same on a resume; the
summary line counts and names them. Text, plain JSONL and ``datasets`` inputs are not checked
(no length or checksum says they were cut).
"""

from __future__ import annotations

from tetrad.data.errors import DataError
from tetrad.data.readers import DamagedFileError, read_to_end
from tetrad.data.sources import JSONL_GZ, JSONL_ZST, PARQUET, Source

CHECKED = (JSONL_GZ, JSONL_ZST, PARQUET)
"""The formats :func:`drop_damaged` reads through."""


def damage_of(source: Source, text_field: str) -> str | None:
    """Why ``source`` cannot be read to its end (the reader's one line), or None when it can
    (or its format is not :data:`CHECKED`). Reads it whole: the cost of one decompression.

    Raises:
        DataError: a problem that is not damage (a record source without ``text_field``).
    """
    if source.format not in CHECKED:
        return None
    try:
        read_to_end(source, text_field)
    except DamagedFileError as e:
        return str(e)
    return None


def drop_damaged(sources: list[Source], text_field: str) -> tuple[list[Source], list[str]]:
    """``sources`` without the damaged ones (:func:`damage_of`), and the paths left out.

    Raises:
        DataError: every input is damaged; a problem that is not damage (a missing field) as
            the reader says it.
    """
    kept, dropped = [], []
    for s in sources:
        if damage_of(s, text_field):
            dropped.append(str(s.path))
        else:
            kept.append(s)
    if not kept:
        raise DataError(
            f"every --data input is damaged ({', '.join(dropped)}): nothing left to prepare"
        )
    return kept, dropped
