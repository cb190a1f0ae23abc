"""A planner model from a Hugging Face ``config.json`` (Llama family). Plain Python."""

from __future__ import annotations

import json
import os

from tetrad.plan.errors import PlanError
from tetrad.plan.model.spec import ModelSpec


def from_hf_config(path: str) -> ModelSpec:
    """A llama-family spec from a Hugging Face ``config.json`` (LlamaForCausalLM style).

    Reads ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads`` (default: the attention heads), ``intermediate_size``,
    ``vocab_size`` and ``tie_word_embeddings`` (default false, as in ``LlamaConfig``).

    Raises:
        PlanError: unreadable file, a missing key, or a head_dim other than hidden/heads.
    """
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(
            f"cannot read the model config {path!r} ({e}): give a readable Hugging Face config.json"
        ) from None
    if not isinstance(cfg, dict):
        raise PlanError(f"{path!r} is not a JSON object: give a Hugging Face config.json")
    arch = cfg.get("architectures") or []
    if cfg.get("model_type", "llama") != "llama" or any("Llama" not in a for a in arch):
        kind = cfg.get("model_type") or ", ".join(arch)
        raise PlanError(
            f"{path!r} describes a {kind} model: tetrad reads Llama models "
            "(model_type llama, LlamaForCausalLM)"
        )
    unsupported = [k for k in ("attention_bias", "mlp_bias") if cfg.get(k)]
    if cfg.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={cfg['hidden_act']}")
    if unsupported:
        raise PlanError(
            f"{path!r} sets {', '.join(unsupported)}: tetrad's Llama has no biases and SwiGLU "
            "with SiLU"
        )
    need = [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "vocab_size",
    ]
    missing = [k for k in need if k not in cfg]
    if missing:
        raise PlanError(
            f"{path!r} lacks {', '.join(missing)}: give a Llama-style config.json "
            "or sizes like hidden=4096,n_layers=32,..."
        )
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim")
    if head_dim is not None and heads and int(head_dim) * heads != hidden:
        raise PlanError(
            f"{path!r} has head_dim={head_dim} != hidden_size/num_attention_heads: "
            "only head_dim * heads == hidden is supported"
        )
    name = cfg.get("_name_or_path") or os.path.basename(os.path.dirname(os.path.abspath(path)))
    return ModelSpec(
        name=str(name) or "hf-model",
        family="llama",
        hidden=hidden,
        n_layers=int(cfg["num_hidden_layers"]),
        n_heads=heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        ffn_hidden=int(cfg["intermediate_size"]),
        vocab=int(cfg["vocab_size"]),
        max_positions=0,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=float(
            cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        ),
    )
