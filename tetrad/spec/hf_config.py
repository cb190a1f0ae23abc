"""Model sizes from a Hugging Face ``config.json``: Llama (with Llama 3.1's RoPE scaling),
Mixtral and Qwen3-MoE. The one reader of those files, for the runtime (``--init-from hf:``,
:mod:`tetrad.models.hf`) and the planner (``--model path/to/config.json``). Plain Python."""

from __future__ import annotations

import dataclasses
import json
import os

from tetrad.spec.model import ModelError, ModelSpec


def from_hf_config(path: str) -> ModelSpec:
    """The sizes of a Hugging Face ``config.json`` (or of a folder holding one).

    Llama (``LlamaForCausalLM``): ``hidden_size``, ``num_hidden_layers``,
    ``num_attention_heads``, ``num_key_value_heads`` (default: the attention heads),
    ``intermediate_size``, ``vocab_size``, ``tie_word_embeddings`` (default false, as in
    ``LlamaConfig``), ``rms_norm_eps`` and RoPE's theta and Llama 3.1's scaling (``rope_type``
    llama3; other scalings are refused). Mixtral and Qwen3-MoE: :func:`moe_config`.

    Raises:
        ModelError: unreadable file, another architecture, a missing key, biases, another
            activation, a head_dim other than hidden/heads, or another RoPE scaling.
    """
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(
            f"cannot read the model config {path!r} ({e}): give a readable Hugging Face config.json"
        ) from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{path!r} is not a JSON object: give a Hugging Face config.json")
    name = cfg.get("_name_or_path") or os.path.basename(os.path.dirname(os.path.abspath(path)))
    if cfg.get("model_type") in ARCHITECTURES:
        return moe_config(cfg, str(name) or "hf-model")
    arch = cfg.get("architectures") or []
    if cfg.get("model_type", "llama") != "llama" or any("Llama" not in a for a in arch):
        kind = cfg.get("model_type") or ", ".join(arch)
        raise ModelError(
            f"{path!r} describes a {kind} model: tetrad reads Llama models "
            "(model_type llama, LlamaForCausalLM)"
        )
    unsupported = [k for k in ("attention_bias", "mlp_bias") if cfg.get(k)]
    if cfg.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={cfg['hidden_act']}")
    if unsupported:
        raise ModelError(
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
        raise ModelError(
            f"{path!r} lacks {', '.join(missing)}: give a Llama-style config.json "
            "or sizes like dim=4096,n_layers=32,..."
        )
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim")
    if head_dim is not None and heads and int(head_dim) * heads != hidden:
        raise ModelError(
            f"{path!r} has head_dim={head_dim} != hidden_size/num_attention_heads: "
            "only head_dim * heads == hidden is supported"
        )
    return ModelSpec(
        name=str(name) or "hf-model",
        family="llama",
        dim=hidden,
        n_layers=int(cfg["num_hidden_layers"]),
        n_heads=heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        ffn_dim=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        max_positions=0,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=float(
            cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        ),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        **_rope_scaling(cfg, path),
    )


def _rope_scaling(cfg: dict, path: str) -> dict:
    """Llama 3.1's RoPE scaling fields of ``cfg`` (none without scaling).

    Raises:
        ModelError: a RoPE scaling other than Llama 3.1's (``llama3``).
    """
    # transformers 5 writes rope_parameters (theta included); earlier, rope_theta + rope_scaling
    scaling = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        return dict(
            rope_factor=float(scaling["factor"]),
            rope_low_freq_factor=float(scaling["low_freq_factor"]),
            rope_high_freq_factor=float(scaling["high_freq_factor"]),
            rope_original_positions=int(scaling["original_max_position_embeddings"]),
        )
    if scaling and kind not in (None, "default"):
        raise ModelError(
            f"{path!r} has rope_scaling of type {kind!r}: tetrad implements Llama 3.1's "
            "(llama3) only"
        )
    return {}


ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _common_sizes(raw: dict) -> dict:
    """The Llama sizes every MoE family shares, checked.

    Raises:
        ModelError: biases, another activation, a sliding window, RoPE scaling, or a
            ``head_dim`` other than hidden/heads.
    """
    heads, hidden = int(raw["num_attention_heads"]), int(raw["hidden_size"])
    rope = raw.get("rope_parameters") or {}
    problems = []
    if raw.get("attention_bias") or raw.get("hidden_act", "silu") != "silu":
        problems.append("attention biases or an activation other than silu")
    if raw.get("head_dim") not in (None, hidden // heads):
        problems.append(f"head_dim={raw['head_dim']} (tetrad needs hidden/heads)")
    windowed = raw.get("use_sliding_window", raw.get("sliding_window") is not None)
    if windowed and raw.get("sliding_window"):
        problems.append(f"a sliding window of {raw['sliding_window']}")
    if (rope.get("rope_type") or "default") != "default" or raw.get("rope_scaling"):
        problems.append("RoPE scaling")
    if problems:
        raise ModelError(
            f"{raw.get('model_type')} config has {'; '.join(problems)}: tetrad cannot run it"
        )
    return dict(
        dim=hidden,
        n_layers=int(raw["num_hidden_layers"]),
        n_heads=heads,
        n_kv_heads=int(raw.get("num_key_value_heads") or heads),
        vocab_size=int(raw["vocab_size"]),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        top_k=int(raw["num_experts_per_tok"]),
        # transformers 5 writes num_local_experts for both; Qwen3's Hub config num_experts
        n_experts=int(raw.get("num_local_experts") or raw["num_experts"]),
    )


def moe_config(raw: dict, name: str = "hf-model") -> ModelSpec:
    """tetrad's sizes of a Mixtral or Qwen3-MoE ``config.json`` (as a dict), with
    ``router_aux_loss_coef`` mapped to tetrad's per-block normalisation
    (:func:`aux_coef_from_hf`). ``output_router_logits`` is not read: transformers adds the
    loss only when it is true, and the Hub's configs set it false, but the coefficient is the one
    the model was trained with, and a fine-tune without balancing risks collapsing routers
    (``--init-from hf:`` takes every size from the folder).

    Raises:
        ModelError: another model type, or a feature tetrad lacks (see
            :func:`_common_sizes`; Qwen3 ``mlp_only_layers`` other than the first blocks).
    """
    kind = raw.get("model_type")
    if kind not in ARCHITECTURES:
        raise ModelError(
            f"model_type {kind!r} is not an MoE tetrad reads: use {', '.join(ARCHITECTURES)}"
        )
    spec = _moe_sizes(raw, kind, name)
    coef = aux_coef_from_hf(float(raw.get("router_aux_loss_coef", 0.0)), spec)
    return dataclasses.replace(spec, aux_loss_coef=coef)


def aux_coef_from_hf(coef: float, model: ModelSpec) -> float:
    """tetrad's ``aux_loss_coef`` for transformers' ``router_aux_loss_coef`` ``c`` of an MoE
    ``model``: ``c k / L_m`` (to 12 significant digits; :func:`aux_coef_to_hf` rounds to 10,
    so a round trip gives back any ``c`` of up to 10 digits and the same tetrad value).

    transformers' ``load_balancing_loss_func`` (Mixtral, Qwen3-MoE) pools the router logits of
    the ``L_m`` MoE blocks into one Switch loss ``E sum_i (slots_i / (L_m T)) P_i``, which is
    ``k`` when balanced, and the model adds ``c`` times it once. tetrad adds ``aux_loss_coef``
    times each block's term, 1 when balanced (Megatron's normalisation,
    :func:`tetrad.models.moe.load_balance_loss`). Copied as it is, ``c`` would pull each
    block's router ``L_m / k`` times harder (Mixtral-8x7B: 16x); with ``c k / L_m`` the two
    losses are equal when every block routes alike (tests/test_hf_moe.py) and both give ``c k``
    when balanced."""
    return float(f"{coef * model.top_k / model.moe_layers:.12g}") if model.moe_layers else 0.0


def aux_coef_to_hf(model: ModelSpec) -> float:
    """transformers' ``router_aux_loss_coef`` for ``model``'s ``aux_loss_coef``: the inverse of
    :func:`aux_coef_from_hf`, ``aux_loss_coef L_m / k``."""
    return float(f"{model.aux_loss_coef * model.moe_layers / model.top_k:.10g}")


def _moe_sizes(raw: dict, kind: str, name: str) -> ModelSpec:
    """The sizes of a Mixtral or Qwen3-MoE config, without the load-balancing coefficient.

    Raises:
        ModelError: see :func:`moe_config`.
    """
    sizes = _common_sizes(raw)
    if kind == "mixtral":
        width = int(raw["intermediate_size"])
        return ModelSpec(name=name, **sizes, ffn_dim=width, expert_ffn_dim=width)
    dense = sorted(int(i) for i in raw.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        raise ModelError(
            f"mlp_only_layers={dense}: tetrad keeps dense FFNs in the first blocks only"
        )
    return ModelSpec(
        name=name,
        **sizes,
        ffn_dim=int(raw["intermediate_size"]),
        expert_ffn_dim=int(raw["moe_intermediate_size"]),
        moe_every=int(raw.get("decoder_sparse_step", 1)),
        dense_layers=len(dense),
        router_renorm=bool(raw.get("norm_topk_prob", False)),
        qk_norm=True,
    )
