"""What ``--data`` names: the input files and their formats.

A ``--data`` entry is a file, a folder (every usable file below it, recursively) or a glob
pattern. Formats, by file name:

- ``*.jsonl``, ``*.jsonl.gz``, ``*.jsonl.zst``: one JSON object per line, the document in its
  ``--text-field`` (default ``text``);
- ``*.parquet``: the ``--text-field`` column;
- a folder holding ``state.json`` and ``dataset_info.json``: a Hugging Face ``datasets``
  ``Dataset`` written by ``save_to_disk`` (its Arrow files), the ``--text-field`` column;
- any other file: text, one document per file, unless it has a NUL byte in its first 8 KiB
  (binary: skipped in folders and globs, refused when named).

A prepared folder (``tetrad prepare``'s ``--out``) is recognised by its ``index.json`` (or, while
unfinished, ``job.json``): :func:`is_prepared`. It is loaded by :mod:`tetrad.data.corpus`, and
skipped inside the folders expanded here (a preparation written inside its own input folder is
not read back as input).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import pathlib
import sysconfig

from tetrad.data.errors import DataError

TEXT, JSONL, JSONL_GZ, JSONL_ZST, PARQUET, DATASETS = (
    "text",
    "jsonl",
    "jsonl.gz",
    "jsonl.zst",
    "parquet",
    "datasets",
)
SUFFIXES = {".jsonl": JSONL, ".jsonl.gz": JSONL_GZ, ".jsonl.zst": JSONL_ZST, ".parquet": PARQUET}
"""File-name endings (lower case) of the record formats; other files are text or binary."""
RECORD_FORMATS = (JSONL, JSONL_GZ, JSONL_ZST, PARQUET, DATASETS)
USABLE = "text, .jsonl(.gz/.zst) or .parquet files, or a datasets folder"
PREPARED_FORMAT = "tetrad-tokens"  # the "format" of a prepared folder's index.json/job.json
INDEX, JOB = "index.json", "job.json"


@dataclasses.dataclass(frozen=True)
class Source:
    """One input: a file, or a ``datasets`` folder.

    Attributes:
        path: the resolved path of the file or folder.
        format: one of ``text, jsonl, jsonl.gz, jsonl.zst, parquet, datasets``.
        files: the files read (the file itself, or the folder's Arrow files).
    """

    path: pathlib.Path
    format: str
    files: tuple[pathlib.Path, ...]

    @property
    def bytes(self) -> int:
        """Size on disk of :attr:`files`, bytes (compressed size for ``.gz``/``.zst``)."""
        return sum(f.stat().st_size for f in self.files)

    def fingerprint(self) -> list[list]:
        """``[path, size in bytes, mtime in ns]`` of each of :attr:`files`: what a cache key and
        a prepared folder's ``index.json`` record of the input."""
        out = []
        for f in self.files:
            st = f.stat()
            out.append([str(f), st.st_size, st.st_mtime_ns])
        return out


def is_prepared(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` is a prepared folder, complete (``index.json``) or not (``job.json``)."""
    for name in (INDEX, JOB):
        try:
            obj = json.loads(pathlib.Path(folder, name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(obj, dict) and obj.get("format") == PREPARED_FORMAT:
            return True
    return False


def _missing(p: str) -> DataError:
    msg = f"data path {p!r} does not exist: pass existing files, folders or globs to --data"
    return DataError(msg)


def _is_text(p: pathlib.Path) -> bool:
    """No NUL byte in the first 8 KiB (how tetrad tells text from binary files)."""
    with open(p, "rb") as f:
        return b"\0" not in f.read(8192)


def format_of(p: pathlib.Path) -> str | None:
    """The format of file ``p`` from its name (:data:`SUFFIXES`), else ``text``, or None for a
    binary file (a NUL byte in its first 8 KiB)."""
    name = p.name.lower()
    for suffix, fmt in SUFFIXES.items():
        if name.endswith(suffix):
            return fmt
    return TEXT if _is_text(p) else None


def _datasets_files(folder: pathlib.Path) -> tuple[pathlib.Path, ...]:
    """The Arrow files of a ``save_to_disk`` folder, from its ``state.json``."""
    try:
        state = json.loads((folder / "state.json").read_text())
        names = [d["filename"] for d in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(
            f"datasets folder {str(folder)!r} has an unreadable state.json ({e}): save it again "
            "with Dataset.save_to_disk"
        ) from None
    files = tuple(folder / n for n in names)
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise DataError(
            f"datasets folder {str(folder)!r} lacks {', '.join(missing)}: save it again with "
            "Dataset.save_to_disk"
        )
    return files


def is_datasets_folder(folder: pathlib.Path) -> bool:
    """A ``Dataset.save_to_disk`` folder: ``state.json`` and ``dataset_info.json``.

    Raises:
        DataError: a ``DatasetDict`` folder (``dataset_dict.json``): name one of its splits.
    """
    if (folder / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in folder.iterdir() if p.is_dir())
        raise DataError(
            f"{str(folder)!r} is a datasets DatasetDict (splits: {', '.join(splits)}): pass one "
            f"split's folder, e.g. {str(folder / (splits[0] if splits else 'train'))!r}"
        )
    return (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()


def _walk(folder: pathlib.Path) -> tuple[list[Source], int]:
    """The usable sources below ``folder`` (``datasets`` folders taken whole) and the number of
    regular files seen."""
    if is_datasets_folder(folder):
        return [Source(folder.resolve(), DATASETS, _datasets_files(folder.resolve()))], 1
    found, seen = [], 0
    for dirpath, dirnames, names in os.walk(folder):
        here = pathlib.Path(dirpath)
        for d in list(dirnames):
            if is_prepared(here / d):
                dirnames.remove(d)
            elif is_datasets_folder(here / d):
                dirnames.remove(d)
                sub = (here / d).resolve()
                found.append(Source(sub, DATASETS, _datasets_files(sub)))
                seen += 1
        for n in names:
            p = here / n
            if not p.is_file():
                continue
            seen += 1
            fmt = format_of(p)
            if fmt is not None:
                found.append(Source(p.resolve(), fmt, (p.resolve(),)))
    return found, seen


def _entry_sources(p: str) -> list[Source]:
    """The sources of one ``--data`` entry; DataError naming what is wrong when none."""
    q = os.path.expanduser(p)
    if os.path.isfile(q):
        fmt = format_of(pathlib.Path(q))
        if fmt is None:
            raise DataError(
                f"data file {p!r} is binary (a NUL byte in its first 8 KiB): pass {USABLE}"
            )
        path = pathlib.Path(q).resolve()
        return [Source(path, fmt, (path,))]
    matches = [q] if os.path.isdir(q) else glob.glob(q, recursive=True)
    if not matches:
        raise _missing(p)
    found, seen = [], 0
    for m in matches:
        if os.path.isdir(m):
            more, n = _walk(pathlib.Path(m))
            found, seen = found + more, seen + n
        elif os.path.isfile(m):
            seen += 1
            fmt = format_of(pathlib.Path(m))
            if fmt is not None:
                path = pathlib.Path(m).resolve()
                found.append(Source(path, fmt, (path,)))
    if not seen:
        raise DataError(f"data path {p!r} holds no files: put text files there or pass others")
    if not found:
        raise DataError(
            f"data path {p!r} holds {seen} file(s), none of them text (each has a NUL "
            f"byte in its first 8 KiB) or another format tetrad reads: pass {USABLE}"
        )
    return found


def stdlib_sources() -> list[Source]:
    """Every ``*.py`` under the running interpreter's standard library
    (``sysconfig.get_paths()["stdlib"]``), excluding ``site-packages``/``dist-packages``: the
    default corpus, as text sources sorted by resolved path.

    Raises:
        DataError: no such file.
    """
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, names in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages")]
        files += [pathlib.Path(dirpath, n) for n in names if n.endswith(".py")]
    if not files:
        raise _missing(root)
    paths = sorted({f.resolve() for f in files if f.is_file()})
    return [Source(f, TEXT, (f,)) for f in paths]


def find_sources(paths: list[str]) -> list[Source]:
    """Expand ``--data`` entries into sources sorted by resolved path, without duplicates.

    With ``paths`` empty: :func:`stdlib_sources`. Otherwise each entry is a file, a folder (its
    usable files, recursively; a ``datasets`` folder taken whole) or a glob pattern
    (``glob.glob(recursive=True)``; matched folders are expanded, binary files skipped).

    Raises:
        DataError: an entry does not exist or matches nothing, is a binary file, holds no file
            or no usable file, or is a ``DatasetDict`` folder (each with its own message).
    """
    if not paths:
        return stdlib_sources()
    by_path = {s.path: s for p in paths for s in _entry_sources(p)}
    return [by_path[k] for k in sorted(by_path)]


def corpus_files(paths: list[str]) -> list[pathlib.Path]:
    """The resolved paths of :func:`find_sources` (a ``datasets`` folder as the folder).

    Raises:
        DataError: as :func:`find_sources`.
    """
    return [s.path for s in find_sources(paths)]
