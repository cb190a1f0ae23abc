"""Sample text from a trained run directory or an exported folder, in one process, without any
process group.

A run directory (written by ``tetrad train``) holds ``config.json`` (with a ``model_config``
object), ``tokenizer.json`` and ``checkpoints/latest`` naming the newest complete
``torch.distributed.checkpoint`` folder, whose keys are ``"model." + parameter name`` with the
full (unsharded) shapes. DCP reshards whatever grid saved it into the full tensors of one
reference :class:`~tetrad.models.reference.Llama`.

An exported folder (written by ``tetrad export``, see :mod:`tetrad.train.export`) holds the same
``config.json`` and ``tokenizer.json`` and the full weights in ``model.safetensors`` (or shards
listed by ``model.safetensors.index.json``); they are read one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import torch

from tetrad.data.tokenizer import END_TOKENS
from tetrad.device import gpu_count
from tetrad.spec.model import ModelSpec
from tetrad.spec.precision import DEVICES
from tetrad.train.checkpoint_dir import CheckpointError, verified_latest
from tetrad.train.config import ConfigError
from tetrad.train.legacy_layout import whole_from_saved


def _first_line(e: BaseException) -> str:
    failures = getattr(e, "failures", None)  # DCP's CheckpointException wraps the real error
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            e = inner[0]
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def read_run_config(run_dir: str | Path) -> dict:
    """The ``config.json`` of a run directory as a dict.

    Raises:
        CheckpointError: missing or unreadable file, or no ``model_config`` object in it.
    """
    path = Path(run_dir) / "config.json"
    if not Path(run_dir).is_dir():
        raise CheckpointError(
            f"run directory {run_dir} does not exist: pass the --run-dir of a "
            "finished `tetrad train`"
        )
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist: {run_dir} is not a tetrad run directory")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({_first_line(e)})") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model_config"), dict):
        raise CheckpointError(f'{path} has no "model_config" object: is it from tetrad train?')
    return cfg


def is_export(folder: str | Path) -> bool:
    """Whether ``folder`` is a folder written by ``tetrad export`` (it has ``model.safetensors``
    or ``model.safetensors.index.json``) rather than a run directory."""
    names = ("model.safetensors", "model.safetensors.index.json")
    return any((Path(folder) / name).is_file() for name in names)


def _load_checkpoint(model: torch.nn.Module, folder: Path, mcfg: ModelSpec) -> None:
    """Load a DCP checkpoint folder into ``model``'s parameters (and persistent buffers: MoE
    routers' selection biases)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    own = {"model." + n: t for n, t in model.state_dict().items()}
    try:
        saved = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        # a stacked weight is saved [2, f, h] and stored [2f, h] (Placement.stacked)
        state = {
            k: torch.empty(tuple(saved[k].size) if k in saved else t.shape, dtype=t.dtype)
            for k, t in own.items()
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
            dcp.load(state, checkpoint_id=str(folder))
        whole = {k: whole_from_saved(k, v).view(own[k].shape) for k, v in state.items()}
        model.load_state_dict({k[len("model.") :]: v for k, v in whole.items()})
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(
            f"checkpoint {folder} cannot be loaded into model {mcfg} ({_first_line(e)})"
        ) from None


def _load_export(model: torch.nn.Module, folder: Path, mcfg: ModelSpec) -> None:
    """Copy the tensors of an exported folder into ``model``'s parameters, one at a time."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    try:
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        params = model.state_dict(keep_vars=True)  # parameters and persistent buffers
        seen: set[str] = set()
        for name in files:
            with safe_open(str(folder / name), framework="pt") as f:
                for key in f.keys():
                    t = f.get_tensor(key)
                    if key not in params or params[key].shape != t.shape:
                        raise ValueError(f"{key} {list(t.shape)} is not a parameter of the model")
                    params[key].data.copy_(t)
                    seen.add(key)
    except Exception as e:
        raise CheckpointError(
            f"export {folder} cannot be loaded into model {mcfg} ({_first_line(e)})"
        ) from None
    if seen != set(params):
        missing = sorted(set(params) - seen)
        raise CheckpointError(
            f"export {folder} lacks {len(missing)} parameters of model {mcfg} (first: "
            f"{missing[0]}): export the run again"
        )


def _is_hf_folder(folder: Path) -> bool:
    """A Hugging Face folder: its ``config.json`` has a ``model_type`` and no ``model_config``."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and "model_type" in cfg and "model_config" not in cfg


def _load_hf_folder(folder: Path, device: str):
    """:func:`load_model` of a Hugging Face Llama folder (such as ``tetrad export --to hf``)."""
    from tokenizers import Tokenizer

    from tetrad.models.hf import load_weights, read_config
    from tetrad.models.reference import Llama
    from tetrad.spec.model import ModelError

    try:
        cfg, raw = read_config(folder)
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        model = Llama(cfg)
        load_weights(model, folder)
    except ModelError as e:
        raise CheckpointError(str(e)) from None
    except Exception as e:
        raise CheckpointError(f"cannot load {folder} ({_first_line(e)})") from None
    run_cfg = {"model_config": dataclasses.asdict(cfg), "hf_config": raw}
    return model.to(device).eval(), tokenizer, run_cfg


def load_model(run_dir: str | Path, device: str = "cpu"):
    """Build the reference Llama of a run directory or an exported folder and load its weights.

    ``run_dir`` is a run directory (its latest checkpoint is loaded) or a folder written by
    ``tetrad export`` (see :func:`is_export`).

    Returns:
        ``(model, tokenizer, run_config)``: the model in eval mode on ``device`` (fp32), the
        HF ``tokenizers.Tokenizer`` and the ``config.json`` dict.

    Raises:
        CheckpointError: no run directory, no checkpoint, or an unreadable/corrupt one; an
            exported folder whose tensors do not match its ``model_config``.
    """
    from tokenizers import Tokenizer

    run_dir = Path(str(run_dir).removeprefix("hf:"))
    if _is_hf_folder(run_dir):
        return _load_hf_folder(run_dir, device)
    run_cfg = read_run_config(run_dir)
    tok_path = run_dir / "tokenizer.json"
    try:
        tokenizer = Tokenizer.from_file(str(tok_path))
    except Exception as e:
        raise CheckpointError(f"cannot read tokenizer {tok_path} ({_first_line(e)})") from None
    sizes = dict(run_cfg["model_config"])
    if not sizes.get("vocab_size"):
        sizes["vocab_size"] = tokenizer.get_vocab_size()
    try:
        mcfg = ModelSpec(**sizes)
    except TypeError as e:
        raise CheckpointError(f"bad model_config in {run_dir}/config.json ({e})") from None
    exported = is_export(run_dir)
    folder = None if exported else verified_latest(run_dir)
    if not exported and folder is None:
        raise CheckpointError(
            f"no checkpoint in {run_dir}/checkpoints: train longer, or with "
            "--checkpoint-every, so that one is written"
        )

    from tetrad.models.reference import Llama

    model = Llama(mcfg)
    if folder is None:
        _load_export(model, run_dir, mcfg)
    else:
        _load_checkpoint(model, folder, mcfg)
    return model.to(device).eval(), tokenizer, run_cfg


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator
) -> int:
    """Sample one token id from ``logits [vocab]``: greedy if ``temperature <= 0``, else
    softmax(logits / temperature) restricted to the ``top_k`` largest (``top_k <= 0``: all)."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(
    run_dir: str | Path,
    prompt: str = "",
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
    device: str = "cpu",
) -> str:
    """Continue ``prompt`` with up to ``max_new_tokens`` tokens sampled from the model of
    ``run_dir``: a run directory (its latest checkpoint) or a folder written by ``tetrad export``.

    The model sees at most the last ``seq_len`` tokens (``seq_len`` from ``config.json``,
    default 256). An empty prompt starts from the end-of-document token (``<|endoftext|>``, or
    a Llama tokenizer's), and sampling stops early at it. Deterministic for a given ``seed``
    and device.

    Returns:
        ``prompt`` followed by the decoded continuation.

    Raises:
        ConfigError: a negative ``max_new_tokens``/``top_k``/``temperature``, or an unknown
            or unavailable ``device``.
        CheckpointError: see :func:`load_model`.
    """
    if max_new_tokens < 0 or top_k < 0 or temperature < 0:
        raise ConfigError("--max-new-tokens, --top-k and --temperature must not be negative")
    if device not in DEVICES:
        raise ConfigError(f"device {device!r} is not cpu or cuda")
    if device == "cuda" and not gpu_count():
        raise ConfigError("--device cuda but no GPU is visible: use --device cpu")
    model, tok, run_cfg = load_model(run_dir, device)
    # config.json holds the [training] section (older runs: a flat seq_len)
    window = int(run_cfg.get("training", run_cfg).get("seq_len") or 256)
    eot = next((i for t in END_TOKENS if (i := tok.token_to_id(t)) is not None), None)
    ids = tok.encode(prompt, add_special_tokens=False).ids if prompt else []
    if not ids:
        ids = [eot if eot is not None else 0]
    gen = torch.Generator(device=device).manual_seed(seed)
    new: list[int] = []
    for _ in range(max_new_tokens):
        x = torch.tensor([ids[-window:]], dtype=torch.long, device=device)
        # the model's vocabulary may be padded past the tokenizer's: never sample padding
        nxt = sample_next(model(x)[0, -1, : tok.get_vocab_size()], temperature, top_k, gen)
        if nxt == eot:
            break
        ids.append(nxt)
        new.append(nxt)
    return prompt + tok.decode(new)
