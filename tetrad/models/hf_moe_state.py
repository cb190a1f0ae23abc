"""transformers 5's in-memory MoE state dicts (``model.state_dict()`` of Mixtral and
Qwen3-MoE: experts fused as ``mlp.experts.gate_up_proj [E, 2F, h]`` = ``[w1; w3]`` along dim 1
and ``mlp.experts.down_proj [E, h, F]``, router ``mlp.gate.weight [E, h]``) in and out of
tetrad's parameters, for conversions without a folder (folders keep the Hub's per-expert
tensors: :mod:`tetrad.models.hf_moe`)."""

from __future__ import annotations

import math

import torch

from tetrad.models.hf import to_hf
from tetrad.models.hf_moe import moe_part
from tetrad.spec.model import ModelError, ModelSpec


def _fused(name: str) -> tuple[str, str] | None:
    """``(hf prefix, what)`` of an MoE parameter in the fused layout, else None."""
    part = moe_part(name)
    return None if part is None else (f"model.layers.{part[0]}.mlp.", part[1])


def to_hf_state(cfg: ModelSpec, state: dict[str, torch.Tensor], vocab: int) -> dict:
    """transformers' state dict of tetrad's full ``state`` (parameter name -> tensor; the
    selection biases of buffers are not exported: Mixtral and Qwen3-MoE have none).

    Raises:
        ModelError: a parameter without a counterpart (a shared expert).
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        moe = _fused(name)
        if moe is None:
            out.update(to_hf(name, t, cfg, vocab))
            continue
        prefix, rest = moe
        if rest == "router.gate.weight":
            out[prefix + "gate.weight"] = t
        elif rest == "experts.w1":
            w3 = state[name[: -len("w1")] + "w3"]
            out[prefix + "experts.gate_up_proj"] = torch.cat([t, w3], dim=1)
        elif rest == "experts.w2":
            out[prefix + "experts.down_proj"] = t
        elif rest != "experts.w3":  # w3 went out with w1
            raise ModelError(f"tetrad parameter {name} has no Hugging Face counterpart")
    return out


def from_hf_state(
    cfg: ModelSpec, hf: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """tetrad's full parameters (``shapes``: name -> shape, e.g. of a reference model) from
    transformers' state dict ``hf``, fp32. A Llama parameter is read through its export map
    (:func:`tetrad.models.hf.to_hf` applied to the element indices, so the two directions
    cannot disagree); padding rows of the vocabulary stay zero.

    Raises:
        KeyError: a tensor missing from ``hf``.
    """
    out = {}
    for name, shape in shapes.items():
        moe = _fused(name)
        if moe is None:
            out[name] = _through_export(name, shape, cfg, hf)
            continue
        prefix, rest = moe
        f = cfg.expert_dim
        if rest == "router.gate.weight":
            t = hf[prefix + "gate.weight"]
        elif rest in ("experts.w1", "experts.w3"):
            rows = slice(0, f) if rest == "experts.w1" else slice(f, 2 * f)
            t = hf[prefix + "experts.gate_up_proj"][:, rows]
        else:
            t = hf[prefix + "experts.down_proj"]
        out[name] = t.float().clone()
    return out


def _through_export(
    name: str, shape: tuple[int, ...], cfg: ModelSpec, hf: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Parameter ``name`` rebuilt from ``hf`` by inverting :func:`to_hf`'s re-layout."""
    index = torch.arange(math.prod(shape)).view(shape)
    flat = torch.zeros(math.prod(shape))
    for hf_name, where in to_hf(name, index, cfg, cfg.unpadded_vocab or cfg.vocab_size).items():
        flat[where.reshape(-1)] = hf[hf_name].reshape(-1).float()
    return flat.view(shape)
