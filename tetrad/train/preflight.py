"""Everything checked before training starts, and the weights a run starts from.

:func:`preflight` runs in the launching process before any worker starts (and again on rank 0
under torchrun), so mistakes stop there with one line.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from tetrad.data.corpus import Corpus, prepare_corpus
from tetrad.device import gpu_count
from tetrad.grid import Grid
from tetrad.models.hf import Weights, load_weights, read_config
from tetrad.parallel.model import ParallelLlama
from tetrad.spec.activation_checkpointing import checkpointed_blocks
from tetrad.spec.conflicts import Settings, check_conflicts
from tetrad.spec.errors import warning_line
from tetrad.spec.model import ModelSpec
from tetrad.spec.sharding import check_grid, check_moe_grid
from tetrad.train.checkpoint_dir import check_files, check_resume, read_meta, tokenizer_hash
from tetrad.train.config import ConfigError, TrainConfig
from tetrad.train.resume import LOCAL_WORKER, check_run_dir, restart_count, start_checkpoint


def preflight(cfg: TrainConfig) -> tuple[Corpus, ModelSpec]:
    """Everything that can fail before workers start: values, run directory, data, tokenizer,
    model vs grid, and the checkpoint a resume would load (its metadata and file sizes).

    Tokenises and caches the corpus, so workers only load it.

    Raises:
        ConfigError, DataError, ModelError, GridError, CheckpointError, CheckpointingError: one-line
            messages saying what to change (ConfigError also for ``--tensorboard`` without the
            tensorboard package).
    """
    cfg.check()
    if cfg.training.device == "cuda" and not gpu_count():
        raise ConfigError("--device cuda but no CUDA device is visible: use --device cpu")
    check_run_dir(cfg.checkpoint.run_dir)
    folder = cfg.hf_folder
    if folder is not None:
        hf_cfg, raw = read_config(folder)
        Weights(folder, hf_cfg, tied=bool(raw.get("tie_word_embeddings")))  # files present?
    if cfg.logging.tensorboard:
        check_tensorboard()
    corpus = load_corpus(cfg)
    _check_seq_len(corpus, cfg.training.seq_len)
    model_cfg = cfg.model_config(corpus.vocab_size)
    if model_cfg.vocab_size < corpus.vocab_size:
        raise ConfigError(
            f"model vocab_size={model_cfg.vocab_size} is smaller than the "
            f"tokenizer's {corpus.vocab_size}: raise it or drop it from the model"
        )
    if folder is not None:
        hf_vocab = hf_cfg.vocab_size
        if corpus.vocab_size > hf_vocab:
            raise ConfigError(
                f"the tokenizer has {corpus.vocab_size:,} tokens but {folder} has a vocabulary "
                f"of {hf_vocab:,}: use the model's own tokenizer.json (drop --tokenizer)"
            )
    check_grid(model_cfg, cfg.parallelism.grid)
    par = cfg.parallelism
    check_moe_grid(model_cfg, par.grid, par.pipe, par.expert_parallel, cfg.training.seq_len)
    if cfg.parallelism.activation_checkpointing != "auto":  # selective:K needs K <= n_layers
        checkpointed_blocks(cfg.parallelism.activation_checkpointing, model_cfg.n_layers)
    start = start_checkpoint(cfg)
    if start is not None:
        meta = read_meta(start)
        check_resume(start, meta, model_cfg, tokenizer_hash(corpus.tokenizer_path))
        if meta is not None:
            check_files(start, meta, digest=False)  # the ranks compare digests when loading
        _check_steps_left(cfg, start, meta)
        _warn_resumed_settings(cfg)
    return corpus, model_cfg


def load_corpus(cfg: TrainConfig) -> Corpus:
    """The corpus of ``cfg``'s ``[data]`` section (:func:`tetrad.data.corpus.prepare_corpus`:
    a prepared folder, or ``--data`` tokenized into the cache with a progress bar on a
    terminal).

    Raises:
        DataError: one line saying what to change.
    """
    d = cfg.data
    return prepare_corpus(
        d.paths,
        d.tokenizer,
        d.vocab_size,
        d.val_fraction,
        text_field=d.text_field,
        encoding_errors=d.encoding_errors,
        workers=d.workers,
        progress=sys.stderr.isatty(),
        skip_bad_files=d.skip_bad_files,
    )


def check_tensorboard() -> None:
    """Raises ConfigError when ``torch.utils.tensorboard`` cannot be imported (the
    ``tensorboard`` package is missing)."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError(
            "--tensorboard needs the tensorboard package: pip install tensorboard, or drop "
            "--tensorboard"
        ) from None


def _check_steps_left(cfg: TrainConfig, start: Path, meta: dict | None) -> None:
    """Raises ConfigError when ``--resume`` would start at or after ``--steps`` (nothing to
    train). A restarted worker is not asked: its run may simply be complete."""
    step = (meta or {}).get("step")
    if step is None or restart_count() or step < cfg.training.steps:
        return
    raise ConfigError(
        f"--resume: the latest checkpoint {start.name} is at step {step}, at or beyond "
        f"--steps {cfg.training.steps}: pass --steps above {step} to train further (the "
        "learning-rate schedule follows --steps)"
    )


def resumed_settings_warnings(cfg: TrainConfig) -> list[str]:
    """The warnings of resuming ``cfg``'s run with other settings than it had
    (``RUN_DIR/config.json``, :mod:`tetrad.spec.conflicts`): another ``--steps`` changes the
    learning-rate schedule. Empty for a run directory without a readable ``config.json``."""
    try:
        saved = json.loads((Path(cfg.checkpoint.run_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return []
    resumed = saved.get("training") if isinstance(saved, dict) else None
    if not isinstance(resumed, dict):
        return []
    now = dataclasses.asdict(cfg.training)
    return check_conflicts(Settings("train", resumed=resumed, training=now))


def _warn_resumed_settings(cfg: TrainConfig) -> None:
    """Print :func:`resumed_settings_warnings` once: in the launching process, or on rank 0
    under ``torchrun`` (not again in a local worker)."""
    env = os.environ
    if "RANK" in env and (env["RANK"] != "0" or LOCAL_WORKER in env):
        return
    for line in resumed_settings_warnings(cfg):
        print(warning_line(line), file=sys.stderr, flush=True)


def _check_seq_len(corpus: Corpus, seq_len: int) -> None:
    """Raises ConfigError when a sample of ``seq_len + 1`` tokens does not fit in the train or
    the validation tokens."""
    for name, tokens in (("train", corpus.train), ("validation", corpus.val)):
        if len(tokens) < seq_len + 1:
            raise ConfigError(
                f"--seq-len {seq_len} needs {seq_len + 1:,} tokens per sample but the {name} "
                f"set has {len(tokens):,}: use --seq-len {max(len(tokens) - 1, 1)} or less"
                + (", a larger --val-fraction" if name == "validation" else "")
                + " or more --data"
            )


PREFLIGHT_TIMEOUT = datetime.timedelta(hours=24)
"""How long the other ranks wait for rank 0's data preparation (tokenising a corpus can take
hours; if rank 0 fails, the launcher ends the others)."""


def preflight_on_rank0(cfg: TrainConfig) -> tuple[Corpus, ModelSpec]:
    """Rank 0 prepares the data first; the others then hit the cache. Errors reach every rank.

    The others wait in a broadcast over a gloo group of their own with a timeout of
    :data:`PREFLIGHT_TIMEOUT`, not in the training's group: NCCL's watchdog ends a collective
    after 10 minutes by default (gloo's after 30), and under ``torchrun`` the preparation runs
    after the world is made (the local launcher prepares before starting the workers)."""
    err: list = [None]
    result = None
    wait = dist.new_group(backend="gloo", timeout=PREFLIGHT_TIMEOUT)
    if dist.get_rank() == 0:
        try:
            result = preflight(cfg)
        except ValueError as e:
            err = [e]
    dist.broadcast_object_list(err, src=0, group=wait)
    dist.destroy_process_group(wait)
    if err[0] is not None:
        raise err[0]
    return result if result is not None else preflight(cfg)


def init_from_hf(model: ParallelLlama, grid: Grid, folder: Path) -> None:
    """Copy this rank's slice of every weight of a Hugging Face Llama folder into ``model``
    (each rank reads only its own rows and columns)."""
    load_weights(model, folder, lambda p: p.placement.local_slices(grid))
