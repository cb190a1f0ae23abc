"""Export a run's latest checkpoint as full (unsharded) safetensors weights, one shard at a time.

Layout of the exported folder ``OUT``::

    OUT/config.json                     the run's config.json as is (with its "model_config")
    OUT/tokenizer.json                  the run's tokenizer
    OUT/model.safetensors               all weights, when they fit in one shard; otherwise
    OUT/model-00001-of-0000N.safetensors ... and
    OUT/model.safetensors.index.json    {"metadata": {"total_size": B}, "weight_map": {name: file}}

Tensor names are the reference model's parameter names (the checkpoint's ``model.<name>`` keys
without ``model.``); the optimizer state and the step are not exported. The checkpoint is read in
this one process, one tensor at a time, and a shard is written as soon as it is full, so memory
holds about one shard plus one tensor, never the whole model (unless it fits in one shard). The
folder is written as ``OUT.tmp`` (a leftover one from an interrupted export is replaced) and
renamed to ``OUT`` at the end: an interrupted export leaves no half-written ``OUT``.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from tetrad.spec.units import GiB
from tetrad.train.checkpoint_dir import CheckpointError, verified_latest
from tetrad.train.generate import _first_line, read_run_config
from tetrad.train.legacy_layout import whole_from_saved

FORMATS = ("safetensors", "hf")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class ExportError(CheckpointError):
    """An export that cannot be made: unknown format or dtype, no checkpoint, an ``OUT`` in use."""


def _model_tensors(folder: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """``{checkpoint key: (global shape, stored dtype)}`` of the ``model.*`` tensors."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        meta = FileSystemReader(str(folder)).read_metadata()
    except Exception as e:
        raise ExportError(f"checkpoint {folder} is unreadable ({_first_line(e)})") from None
    found = {
        k: (m.size, m.properties.dtype)
        for k, m in meta.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    if not found:
        raise ExportError(f"checkpoint {folder} holds no model.* tensors: is it from tetrad train?")
    return found


def _shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Keys in order, grouped greedily into shards of at most ``max_shard_bytes``."""
    shards: list[list[str]] = [[]]
    used = 0
    for key, n in sizes.items():
        if shards[-1] and used + n > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += n
    return shards


def _load_one(folder: Path, key: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    t = torch.empty(shape, dtype=dtype)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load({key: t}, checkpoint_id=str(folder), no_dist=True)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise ExportError(
            f"cannot read {key} from checkpoint {folder} ({_first_line(e)}): it is corrupt"
        ) from None
    return t


def _writer_setup(fmt: str, run_dir: Path, tmp: Path, tokenizer: Path, dtype, tensors) -> Callable:
    """Write the config and tokenizer files of format ``fmt`` into ``tmp``; returns the map
    from one tetrad tensor (name, full tensor) to the tensors written for it."""
    shutil.copyfile(tokenizer, tmp / "tokenizer.json")
    if fmt == "safetensors":
        shutil.copyfile(run_dir / "config.json", tmp / "config.json")
        return lambda name, t: {name: t}
    from tetrad.models.hf import hf_config, to_hf
    from tetrad.spec.model import ModelSpec

    run_cfg = read_run_config(run_dir)
    cfg = ModelSpec(**run_cfg["model_config"])
    base = run_cfg.get("hf_config")
    vocab = int(base["vocab_size"]) if base else cfg.vocab_size
    stored = next(iter(tensors.values()))[1]
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[
        DTYPES[dtype] if dtype else stored
    ]
    config = hf_config(cfg, vocab, base, name)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    source = str(run_cfg.get("model", {}).get("init_from", ""))
    for extra in ("tokenizer_config.json", "special_tokens_map.json"):
        if source.startswith("hf:") and (Path(source[3:]) / extra).is_file():
            shutil.copyfile(Path(source[3:]) / extra, tmp / extra)
    return lambda name, t: to_hf(name, t, cfg, vocab)


def _check_output(out: Path) -> None:
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ExportError(f"{out} already exists and is not an empty folder: give a new OUT folder")


def export(
    run_dir: str | Path,
    out_dir: str | Path,
    *,
    fmt: str = "safetensors",
    dtype: str | None = None,
    max_shard_bytes: int = 2 * GiB,
) -> Path:
    """Write the full weights of ``run_dir``'s latest checkpoint, its config and tokenizer to
    ``out_dir`` (see the module docstring for the layout).

    Args:
        run_dir: a run directory written by ``tetrad train``.
        out_dir: the folder to create; it must not exist, or be empty.
        fmt: ``"safetensors"`` (tetrad's names and ``config.json``) or ``"hf"`` (a Hugging Face
            Llama folder: :func:`tetrad.models.hf.to_hf` names and layouts, vocabulary padding
            dropped, ``config.json`` and ``generation_config.json`` for transformers).
        dtype: ``"float32"`` or ``"bfloat16"`` to cast every tensor to; None keeps the
            checkpoint's dtype.
        max_shard_bytes: the most bytes of tensor data in one ``.safetensors`` file (a tensor
            larger than that is a shard of its own); peak memory is about one shard plus the
            largest tensor.

    Returns:
        ``out_dir`` as a Path. Every tensor has its full (global) shape, e.g. ``[vocab, dim]``
        for ``tok_embeddings.weight``, whatever grid saved the checkpoint.

    Raises:
        ExportError: an unknown ``fmt`` or ``dtype``, ``max_shard_bytes < 1``, no checkpoint in
            ``run_dir``, an unreadable checkpoint, ``out_dir`` exists and is not empty, or it
            cannot be written.
        CheckpointError: ``run_dir`` or its ``config.json`` is missing, or ``latest`` names an
            incomplete checkpoint.
    """
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise ExportError(f"export format {fmt!r} is not one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if max_shard_bytes < 1:
        raise ExportError(f"shard size of {max_shard_bytes} bytes: give a positive --max-shard-mb")
    run_dir, out = Path(run_dir), Path(out_dir).resolve()
    read_run_config(run_dir)
    _check_output(out)
    tokenizer = run_dir / "tokenizer.json"
    if not tokenizer.is_file():
        raise ExportError(f"{tokenizer} does not exist: {run_dir} is not a tetrad run directory")
    folder = verified_latest(run_dir)
    if folder is None:
        raise ExportError(
            f"no checkpoint in {run_dir}/checkpoints: train longer, or with --checkpoint-every, "
            "so that one is written"
        )
    tensors = _model_tensors(folder)
    out_dtype = {k: DTYPES[dtype] if dtype else dt for k, (_, dt) in tensors.items()}
    nbytes = {k: s.numel() * out_dtype[k].itemsize for k, (s, _) in tensors.items()}
    shards = _shards(nbytes, max_shard_bytes)
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )

    tmp = out.with_name(out.name + ".tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted export
        tmp.mkdir(parents=True)
        convert = _writer_setup(fmt, run_dir, tmp, tokenizer, dtype, tensors)
        weight_map, total = {}, 0
        for keys, name in zip(shards, names, strict=True):
            shard = {}
            for k in keys:
                t = whole_from_saved(k, _load_one(folder, k, tensors[k][0], tensors[k][1]))
                for out_name, v in convert(k[len("model.") :], t).items():
                    shard[out_name] = v.to(out_dtype[k]).contiguous()
                    total += shard[out_name].nbytes
                del t
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            shutil.copymode(tmp / "config.json", tmp / name)  # save_file makes it owner-only
            weight_map.update(dict.fromkeys(shard, name))
            del shard
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        os.replace(tmp, out)  # fails if someone wrote into OUT meanwhile
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(f"cannot write {out} ({_first_line(e)}): choose another OUT") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
