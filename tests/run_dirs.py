"""Run directories and checkpoints made by hand, for the generate, export and Hugging Face tests."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import torch
from torch import nn

from tetrad.train.legacy_layout import STACKED_NAMES


def bpe_tokenizer(end_token: str = "<|endoftext|>"):
    """A byte-level BPE of about 300 tokens trained on one line of Python, with ``end_token``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    bpe = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[end_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["def add(a, b):\n    return a + b\n"] * 20, trainer=bpe)
    return tok


def fake_run_dir(path: Path, model_config, name: str = "step_0000300") -> Path:
    """A run directory (``config.json``, ``tokenizer.json``, ``latest`` naming ``name``) without
    a checkpoint; returns the checkpoint folder ``latest`` names."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"model_config": dataclasses.asdict(model_config), "training": {"seq_len": 8}}
    (path / "config.json").write_text(json.dumps(cfg))
    bpe_tokenizer().save(str(path / "tokenizer.json"))
    (path / "checkpoints").mkdir(exist_ok=True)
    (path / "checkpoints" / "latest").write_text(name + "\n")
    return path / "checkpoints" / name


def saved_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape ``tetrad train`` saves a plain parameter of ``shape`` as: a stacked weight
    ``[2f, h]`` (SwiGLU's ``w13``) as ``[2, f, h]``, anything else as it is."""
    if name.endswith(STACKED_NAMES):
        return (2, shape[0] // 2, *shape[1:])
    return tuple(shape)


def save_checkpoint(model: nn.Module, folder: Path) -> None:
    """A one-process checkpoint with the keys ``tetrad train`` writes: model, optimizer state
    and step."""
    import torch.distributed.checkpoint as dcp

    state: dict = {"step": torch.tensor(300)}
    for n, p in model.named_parameters():
        state["model." + n] = p.detach().view(saved_shape(n, p.shape))
        state[f"optim.{n}.exp_avg"] = torch.zeros(saved_shape(n, p.shape))
        state[f"optim.{n}.step"] = torch.tensor(300.0)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder))


def save_sharded(folder: str, names: list[str], shapes: list[tuple[int, ...]]) -> None:
    """On 2 gloo ranks (``run_distributed``): ``torch.randn`` tensors (seed 0) saved as DTensors
    sharded on dim 0, under ``model.<name>``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    full = [torch.randn(saved_shape(n, s)) for n, s in zip(names, shapes, strict=True)]
    state = {
        "model." + n: distribute_tensor(t, mesh, [Shard(0)])
        for n, t in zip(names, full, strict=True)
    }
    dcp.save(state, checkpoint_id=folder)
