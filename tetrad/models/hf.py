"""Hugging Face Llama folders: sizes from ``config.json``, weights in and out of tetrad's layout.

A folder holds ``config.json`` (``LlamaForCausalLM``), ``model.safetensors`` or shards listed by
``model.safetensors.index.json``, and usually ``tokenizer.json``. The names map one to one,
except the two fused projections (:mod:`tetrad.models.llama`)::

    tok_embeddings.weight              model.embed_tokens.weight
    layers.L.attention_norm.weight     model.layers.L.input_layernorm.weight
    layers.L.attention.wqkv.weight     model.layers.L.self_attn.{q,k,v}_proj.weight, rows grouped
                                       per KV head j: q heads j*g .. j*g+g-1, k_j, v_j
    layers.L.attention.wo.weight       model.layers.L.self_attn.o_proj.weight
    layers.L.ffn_norm.weight           model.layers.L.post_attention_layernorm.weight
    layers.L.feed_forward.w13.weight   model.layers.L.mlp.{gate,up}_proj.weight, stacked [2, f, h]
    layers.L.feed_forward.w2.weight    model.layers.L.mlp.down_proj.weight
    norm.weight                        model.norm.weight
    output.weight                      lm_head.weight (embed_tokens with tied embeddings)

Both sides rotate q and k with the rotate-half pairing, so no head permutation is needed. tetrad
pads the vocabulary to divide the grid; padding rows load as zeros and are dropped on export.
Mixtral and Qwen3-MoE folders: the same, with the experts' names and sizes of
:mod:`tetrad.models.hf_moe`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from tetrad.models.hf_moe import hub_kind, moe_hf_config, moe_to_hub, read_moe
from tetrad.spec.hf_config import from_hf_config
from tetrad.spec.model import ModelError, ModelSpec, check_trainable

PREFIX = "hf:"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

_PLAIN = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",  # Qwen3's q/k norms
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}


def hf_folder(spec: str) -> Path | None:
    """The folder of a model given as ``hf:PATH``, or None for any other model string."""
    return Path(spec[len(PREFIX) :]) if spec.startswith(PREFIX) else None


def read_config(folder: Path) -> tuple[ModelSpec, dict]:
    """The sizes of a Hugging Face Llama, Mixtral or Qwen3-MoE folder
    (:func:`tetrad.spec.hf_config.from_hf_config`), and its raw ``config.json``.

    ``vocab_size`` is the folder's (tetrad pads it to the grid later); tied embeddings load into
    tetrad's separate LM head (:class:`Weights` copies the embedding).

    Raises:
        ModelError: a missing or unreadable ``config.json``, another architecture, biases,
            another activation, a ``head_dim`` other than hidden/heads, or another RoPE scaling.
    """
    spec = check_trainable(dataclasses.replace(from_hf_config(str(folder)), tied_embeddings=False))
    return spec, json.loads((folder / "config.json").read_text())


def open_safetensors(path: Path):
    """``safe_open(path)`` (PyTorch tensors), which reads the file's header.

    Raises:
        ModelError: the header cannot be read (a truncated or corrupt file), naming it.
    """
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors' SafetensorError, or an OSError
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelError(
            f"{path} is not a readable safetensors file ({why}): download or export it again"
        ) from None


class Weights:
    """The safetensors files of a folder, read slice by slice (``safe_open(...).get_slice``):
    a rank reads only the rows and columns of its own shards.

    Raises (on construction):
        ModelError: no ``model.safetensors`` nor index, a file listed but missing, or a
            file whose safetensors header cannot be read (each file's header is read here).
    """

    def __init__(self, folder: Path, cfg: ModelSpec, tied: bool):
        self.cfg, self.tied, self.folder = cfg, tied, folder
        self._open: dict[str, object] = {}
        index = folder / INDEX
        if index.is_file():
            files = json.loads(index.read_text())["weight_map"]
        elif (folder / SINGLE).is_file():
            self._open[SINGLE] = open_safetensors(folder / SINGLE)
            files = dict.fromkeys(self._open[SINGLE].keys(), SINGLE)  # type: ignore[attr-defined]
        else:
            raise ModelError(f"{folder} has neither {SINGLE} nor {INDEX}: no weights to load")
        for name in set(files.values()):
            if not (folder / name).is_file():
                raise ModelError(f"{folder / name} (listed in {INDEX}) is missing")
            if name not in self._open:
                self._open[name] = open_safetensors(folder / name)
        self.files = files
        embed = _PLAIN["tok_embeddings.weight"]
        self.vocab = self._slice(embed).get_shape()[0] if embed in files else 0

    def _slice(self, name: str):
        """safetensors' lazy slice of tensor ``name`` (its file opened once)."""
        if name not in self.files:
            raise ModelError(f"{self.folder} lacks the tensor {name}: is it a Llama folder?")
        return self._open[self.files[name]].get_slice(name)  # type: ignore[attr-defined]

    def _rows(self, name: str, rows: slice, cols: slice) -> torch.Tensor:
        """``name[rows, cols]`` (or ``name[rows]`` for a vector) read from its file."""
        piece = self._slice(name)
        return piece[rows] if len(piece.get_shape()) == 1 else piece[rows, cols]

    def read(self, name: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """tetrad's parameter ``name`` (its global tensor) restricted to ``slices``, in fp32.

        Raises:
            ModelError: a tensor missing from the folder.
        """
        moe = read_moe(self._rows, name, slices, self.cfg)
        if moe is not None:
            return moe.float()
        if name.endswith("feed_forward.w13.weight"):
            return self._gate_up(f"model.layers.{name.split('.')[1]}.", slices).float()
        rows = slices[0]
        cols = slices[1] if len(slices) > 1 else slice(None)
        parts = name.split(".")
        if name == "norm.weight":
            return self._rows(_PLAIN[name], rows, cols).float()
        if name in _PLAIN:
            source = _PLAIN[name]
            if name == "output.weight" and self.tied:
                source = _PLAIN["tok_embeddings.weight"]
            return self._vocab_rows(source, rows, cols).float()
        layer, rest = f"model.layers.{parts[1]}.", ".".join(parts[2:])
        if rest in _LAYER:
            return self._rows(layer + _LAYER[rest], rows, cols).float()
        if rest == "attention.wqkv.weight":
            return torch.cat(list(self._qkv_rows(layer, rows, cols))).float()
        raise ModelError(f"tetrad parameter {name} has no Hugging Face counterpart")

    def _gate_up(self, layer: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """``w13`` (``[2, f, h]``: gate_proj and up_proj stacked) restricted to ``slices``: three
        of the stacked tensor, or two of its ``[2f, h]`` storage (rows across both halves)."""
        names = (layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight")
        f = self.cfg.ffn_dim
        if len(slices) == 3:
            halves, rows, cols = slices
            return torch.stack([self._rows(names[i], rows, cols) for i in range(2)[halves]])
        rows, cols = slices[0], slices[1] if len(slices) > 1 else slice(None)
        parts = []
        for i, name in enumerate(names):  # storage rows [i f, (i+1) f) are matrix i's
            lo, hi = max(rows.start, i * f), min(rows.stop, (i + 1) * f)
            if lo < hi:
                parts.append(self._rows(name, slice(lo - i * f, hi - i * f), cols))
        return torch.cat(parts)

    def _vocab_rows(self, name: str, rows: slice, cols: slice) -> torch.Tensor:
        """Rows of an embedding-like tensor; rows past the folder's vocabulary are zeros."""
        real = min(rows.stop, self.vocab)
        out = torch.zeros(rows.stop - rows.start, self._width(cols))
        if real > rows.start:
            out[: real - rows.start] = self._rows(name, slice(rows.start, real), cols)
        return out

    def _width(self, cols: slice) -> int:
        stop = self.cfg.dim if cols.stop is None else cols.stop
        return stop - (cols.start or 0)

    def _qkv_rows(self, layer: str, rows: slice, cols: slice) -> Iterator[torch.Tensor]:
        """The fused q/k/v rows ``rows`` as runs read from q_proj, k_proj and v_proj."""
        cfg, hd = self.cfg, self.cfg.head_dim
        g = cfg.n_heads // cfg.n_kv_heads
        r = rows.start
        while r < rows.stop:
            j, within = divmod(r, (g + 2) * hd)
            slot, off = divmod(within, hd)
            n = min(hd - off, rows.stop - r)
            if slot < g:
                name, base = "self_attn.q_proj.weight", (j * g + slot) * hd
            else:
                name = "self_attn.k_proj.weight" if slot == g else "self_attn.v_proj.weight"
                base = j * hd
            yield self._rows(layer + name, slice(base + off, base + off + n), cols)
            r += n


def load_weights(
    model: torch.nn.Module,
    folder: Path,
    slices: Callable[[torch.nn.Parameter], tuple[slice, ...]] | None = None,
) -> None:
    """Copy the weights of the Hugging Face folder into ``model``'s parameters (tetrad names),
    each parameter ``p`` reading only ``slices(p)`` of its global tensor (default: all of it;
    a rank of the grid passes its ``p.placement.local_slices(grid)``).

    Raises:
        ModelError: see :func:`read_config` and :class:`Weights`.
    """
    cfg, raw = read_config(folder)
    weights = Weights(folder, cfg, tied=bool(raw.get("tie_word_embeddings", False)))
    whole = lambda p: tuple(slice(0, n) for n in p.shape)  # noqa: E731
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights.read(name, (slices or whole)(p)).reshape(p.shape))


def to_hf(name: str, full: torch.Tensor, cfg: ModelSpec, vocab: int) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors of tetrad's full parameter ``name`` (vocabulary rows beyond
    ``vocab`` dropped; an MoE parameter gives one tensor per expert)."""
    moe = moe_to_hub(name, full, cfg)
    if moe is not None:
        return moe
    if name in _PLAIN:
        return {_PLAIN[name]: full[:vocab] if name != "norm.weight" else full}
    parts = name.split(".")
    layer, rest = f"model.layers.{parts[1]}.", ".".join(parts[2:])
    if rest in _LAYER:
        return {layer + _LAYER[rest]: full}
    if rest == "feed_forward.w13.weight":  # [2, f, h], or stored [2f, h]
        gate, up = full.reshape(2, -1, full.shape[-1])
        return {layer + "mlp.gate_proj.weight": gate, layer + "mlp.up_proj.weight": up}
    if rest == "attention.wqkv.weight":
        g, hd = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
        groups = full.unflatten(0, (cfg.n_kv_heads, g + 2, hd))
        return {
            layer + "self_attn.q_proj.weight": groups[:, :g].flatten(0, 2),
            layer + "self_attn.k_proj.weight": groups[:, g].flatten(0, 1),
            layer + "self_attn.v_proj.weight": groups[:, g + 1].flatten(0, 1),
        }
    raise ModelError(f"tetrad parameter {name} has no Hugging Face counterpart")


def hf_config(cfg: ModelSpec, vocab: int, base: dict | None, dtype: str) -> dict:
    """``config.json`` of an exported folder: ``base`` (the folder the run started from, if
    any) with the sizes, untied embeddings (tetrad trains the LM head apart) and ``dtype``."""
    out = dict(base or {})
    if cfg.is_moe:  # Mixtral or Qwen3-MoE (raises if neither expresses cfg)
        return out | moe_hf_config(cfg, hub_kind(cfg), vocab) | {"torch_dtype": dtype}
    out.update(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=cfg.dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.ffn_dim,
        vocab_size=vocab,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        torch_dtype=dtype,
    )
    rope: dict = {"rope_type": "default"}
    if cfg.rope_factor != 1.0:
        rope = dict(
            rope_type="llama3",
            factor=cfg.rope_factor,
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_positions,
        )
    if "rope_parameters" in out:  # the layout of transformers 5
        out.pop("rope_theta")
        out["rope_parameters"] = rope | {"rope_theta": cfg.rope_theta}
    elif cfg.rope_factor != 1.0:
        out["rope_scaling"] = rope
    out.setdefault("max_position_embeddings", max(cfg.rope_original_positions, 2048))
    return out
