"""A run's checkpoint folders on disk: layout, metadata, integrity, the ``latest`` pointer,
retention. Plain files; no process group (the collective parts are in
:mod:`tetrad.train.checkpoint`).

Layout of ``RUN_DIR/checkpoints/``::

    step_0000300/            a complete checkpoint: DCP files (``__R_0.distcp`` written by
                             rank R, ``.metadata``) and ``tetrad.json``
    step_0000400.tmp/        a checkpoint being written (or left by a crash: never loaded)
    latest                   one line, the name of the newest complete checkpoint

A checkpoint is written into ``step_N.tmp``; once every rank's files are on disk, rank 0 writes
``tetrad.json`` (human-readable: step, grid, model config, tokenizer hash, tetrad version, data
position, and the size and SHA-256 of every file) and renames the folder to ``step_N``, then
replaces ``latest`` atomically, then removes checkpoints beyond ``--keep-last``. A crash at any
point leaves ``latest`` naming a complete checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

from tetrad.spec.errors import TetradError

META = "tetrad.json"
POINTER = "latest"


class CheckpointError(TetradError):
    """A checkpoint that is missing, incomplete, corrupt or does not match the run."""


def step_dir(run_dir: str | Path, step: int) -> Path:
    """The folder of the checkpoint after ``step`` optimizer steps."""
    return Path(run_dir) / "checkpoints" / f"step_{step:07d}"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder of a run, or None if it has none.

    Raises:
        CheckpointError: ``latest`` names a folder that is missing or incomplete.
    """
    pointer = Path(run_dir) / "checkpoints" / POINTER
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    if path.suffix == ".tmp" or not (path / ".metadata").is_file():
        raise CheckpointError(
            f"checkpoint {path} named by {pointer} is missing or incomplete: "
            "write the name of a complete step_* folder into it, or delete it to start over"
        )
    return path


def verified_latest(run_dir: str | Path) -> Path | None:
    """:func:`latest_checkpoint`, with every file checked against the sizes and SHA-256 its
    ``tetrad.json`` recorded (for readers in one process: generate, export).

    Raises:
        CheckpointError: a bad pointer, or a missing, truncated or corrupt file (named).
    """
    path = latest_checkpoint(run_dir)
    meta = read_meta(path) if path is not None else None
    if path is not None and meta is not None:
        check_files(path, meta, digest=True)
    return path


def leftovers(run_dir: str | Path) -> list[Path]:
    """``step_*.tmp`` folders: checkpoints a crash interrupted (ignored, removed at the next
    save)."""
    return sorted((Path(run_dir) / "checkpoints").glob("step_*.tmp"))


def file_digest(path: Path) -> dict:
    """``{"bytes": size, "sha256": hex digest}`` of one file."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def rank_files(folder: Path, rank: int) -> list[Path]:
    """The files of ``folder`` that DCP's file-system writer wrote on ``rank``
    (``__R_*.distcp``; rank 0, the coordinator, also ``.metadata``)."""
    files = sorted(folder.glob(f"__{rank}_*"))
    return files + ([folder / ".metadata"] if rank == 0 else [])


def write_meta(folder: Path, meta: dict, files: dict[str, dict]) -> None:
    """Write ``tetrad.json`` into ``folder``: ``meta`` plus ``files`` (name -> size, SHA-256)."""
    tmp = folder / (META + ".tmp")
    tmp.write_text(json.dumps(meta | {"files": files}, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, folder / META)


def read_meta(folder: Path) -> dict | None:
    """The ``tetrad.json`` of a checkpoint folder, or None for a checkpoint written without one.

    Raises:
        CheckpointError: the file exists but is not a JSON object.
    """
    path = folder / META
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(
            f"{path} is not valid JSON ({e}): the checkpoint is corrupt"
        ) from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} is not a JSON object: the checkpoint is corrupt")
    return meta


def _restore_hint(folder: Path) -> str:
    return (
        f"restore it, or write the name of an older step_* folder into "
        f"{folder.parent / POINTER} (or start a fresh --run-dir)"
    )


def check_files(folder: Path, meta: dict, names: list[str] | None = None, *, digest: bool) -> None:
    """Check the files recorded in ``meta`` (all, or ``names``) against the disk: present, of
    the recorded size and, with ``digest``, of the recorded SHA-256.

    Raises:
        CheckpointError: one line naming the first missing, truncated or corrupt file.
    """
    recorded = meta.get("files", {})
    for name in recorded if names is None else names:
        path, want = folder / name, recorded[name]
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing: {_restore_hint(folder)}")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(
                f"checkpoint file {path} is truncated or damaged ({size:,} bytes, "
                f"{want['bytes']:,} when saved): {_restore_hint(folder)}"
            )
        if digest and file_digest(path)["sha256"] != want["sha256"]:
            raise CheckpointError(
                f"checkpoint file {path} is corrupt (its SHA-256 differs from the one "
                f"recorded when saved): {_restore_hint(folder)}"
            )


def commit(tmp: Path, keep_last: int) -> Path:
    """Rename the finished ``step_N.tmp`` to ``step_N``, point ``latest`` at it, then remove
    complete checkpoints beyond the ``keep_last`` newest (0 keeps all). Rank 0 only."""
    final = tmp.with_suffix("")
    shutil.rmtree(final, ignore_errors=True)  # a copy left by a crash after an earlier rename
    os.replace(tmp, final)
    pointer = final.parent / (POINTER + ".tmp")
    pointer.write_text(final.name + "\n")
    os.replace(pointer, final.parent / POINTER)
    if keep_last:
        done = sorted(p for p in final.parent.glob("step_*") if p.suffix != ".tmp")
        for old in done[:-keep_last]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


def tokenizer_hash(path: str | Path) -> str:
    """SHA-256 of a ``tokenizer.json`` file (vocabulary and merges): a resume with another
    tokenizer is refused."""
    return file_digest(Path(path))["sha256"]


def check_resume(folder: Path, meta: dict | None, model_config: object, tok_hash: str) -> None:
    """Refuse to resume a checkpoint saved for another model or tokenizer.

    Args:
        folder: the checkpoint folder; ``meta`` its :func:`read_meta`.
        model_config: this run's :class:`tetrad.spec.model.ModelSpec`.
        tok_hash: :func:`tokenizer_hash` of this run's tokenizer.

    Raises:
        CheckpointError: one line naming the first differences (model sizes, vocabulary,
            tokenizer) and what to change.
    """
    if meta is None:
        return
    if meta.get("tokenizer_sha256") not in (None, tok_hash):
        raise CheckpointError(
            f"checkpoint {folder} was saved with another tokenizer (tokenizer.json differs): "
            "resume with the run's --data, --tokenizer and --vocab-size, or use a fresh --run-dir"
        )
    ours = dataclasses.asdict(model_config)  # type: ignore[call-overload]
    saved = meta.get("model_config", {})
    diff = [k for k in ours if k in saved and saved[k] != ours[k] and k != "name"]
    if diff:
        was = ", ".join(f"{k}={saved[k]}" for k in diff)
        now = ", ".join(f"{k}={ours[k]}" for k in diff)
        raise CheckpointError(
            f"checkpoint {folder} was saved for a model with {was}; this run has {now}: "
            "resume with the same --model (and sizes), or use a fresh --run-dir"
        )
