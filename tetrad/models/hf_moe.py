"""Hugging Face Mixtral and Qwen3-MoE: sizes from ``config.json`` and whole state dicts in and
out of tetrad's layout (transformers 5's fused 3-D expert tensors).

Names, beyond the Llama ones of :mod:`tetrad.models.hf` (``L`` a block, ``mlp`` Mixtral's and
Qwen3-MoE's MoE block in transformers 5; Hub checkpoints of transformers 4 name Mixtral's
``block_sparse_moe`` with per-expert ``w1/w2/w3``, converted by transformers on load)::

    layers.L.feed_forward.router.gate.weight  [E, h]    model.layers.L.mlp.gate.weight
    layers.L.feed_forward.experts.w1          [E, F, h] model.layers.L.mlp.experts.gate_up_proj
    layers.L.feed_forward.experts.w3          [E, F, h]     [E, 2F, h]: rows :F (gate), F: (up)
    layers.L.feed_forward.experts.w2          [E, h, F] model.layers.L.mlp.experts.down_proj
    layers.L.attention.{q,k}_norm.weight      [d]       model.layers.L.self_attn.{q,k}_norm.weight
                                                        (Qwen3)

Sizes: Mixtral (``num_local_experts``, ``num_experts_per_tok``, ``intermediate_size`` = the
expert width; softmax over all experts, top-k, renormalised: ``MixtralTopKRouter``);
Qwen3-MoE (``num_experts``, ``moe_intermediate_size``, ``norm_topk_prob``,
``decoder_sparse_step``, ``mlp_only_layers`` = the first blocks only, q/k norms; the dense
blocks' width ``intermediate_size``). The router's aux-loss coefficient is taken as it is, but
tetrad's loss is per MoE block with balanced routing giving 1 (:func:`tetrad.models.moe.
load_balance_loss`), where transformers' pools every layer's tokens and gives ``k``.
"""

from __future__ import annotations

import math

import torch

from tetrad.models.config import ModelConfig, ModelConfigError
from tetrad.models.hf import to_hf

ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _common_sizes(raw: dict) -> dict:
    """The Llama sizes every MoE family shares, checked.

    Raises:
        ModelConfigError: biases, another activation, a sliding window, RoPE scaling, or a
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
        raise ModelConfigError(
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
        aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.0)),
    )


def moe_config(raw: dict) -> ModelConfig:
    """tetrad's sizes of a Mixtral or Qwen3-MoE ``config.json`` (as a dict).

    Raises:
        ModelConfigError: another model type, or a feature tetrad lacks (see
            :func:`_common_sizes`; Qwen3 ``mlp_only_layers`` other than the first blocks).
    """
    kind = raw.get("model_type")
    if kind not in ARCHITECTURES:
        raise ModelConfigError(
            f"model_type {kind!r} is not an MoE tetrad reads: use {', '.join(ARCHITECTURES)}"
        )
    sizes = _common_sizes(raw)
    if kind == "mixtral":
        width = int(raw["intermediate_size"])
        return ModelConfig(**sizes, ffn_dim=width, expert_ffn_dim=width)
    dense = sorted(int(i) for i in raw.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        raise ModelConfigError(
            f"mlp_only_layers={dense}: tetrad keeps dense FFNs in the first blocks only"
        )
    return ModelConfig(
        **sizes,
        ffn_dim=int(raw["intermediate_size"]),
        expert_ffn_dim=int(raw["moe_intermediate_size"]),
        moe_every=int(raw.get("decoder_sparse_step", 1)),
        dense_layers=len(dense),
        router_renorm=bool(raw.get("norm_topk_prob", False)),
        qk_norm=True,
    )


def moe_hf_config(cfg: ModelConfig, kind: str, vocab: int) -> dict:
    """The ``config.json`` (a dict) of ``cfg`` as a ``kind`` model (``mixtral`` or
    ``qwen3_moe``), fp32, untied embeddings.

    Raises:
        ModelConfigError: ``cfg`` is not expressible in that family (a shared expert, a sigmoid
            router, route scaling; Mixtral: dense blocks or no renormalisation; Qwen3: no q/k
            norm).
    """
    bad = cfg.shared_ffn_dim or cfg.router_score != "softmax" or cfg.route_scale != 1.0
    if kind == "mixtral":
        bad = bad or cfg.moe_blocks() != cfg.n_layers or not cfg.router_renorm or cfg.qk_norm
    elif kind == "qwen3_moe":
        bad = bad or not cfg.qk_norm
    if bad or kind not in ARCHITECTURES or not cfg.is_moe:
        raise ModelConfigError(f"this model has no {kind} equivalent in transformers")
    out = dict(
        architectures=[ARCHITECTURES[kind]],
        model_type=kind,
        hidden_size=cfg.dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        vocab_size=vocab,
        rms_norm_eps=cfg.norm_eps,
        hidden_act="silu",
        tie_word_embeddings=False,
        num_experts_per_tok=cfg.top_k,
        router_aux_loss_coef=cfg.aux_loss_coef,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        torch_dtype="float32",
    )
    if kind == "mixtral":
        return out | dict(
            num_local_experts=cfg.n_experts, intermediate_size=cfg.expert_dim, sliding_window=None
        )
    return out | dict(
        num_experts=cfg.n_experts,
        moe_intermediate_size=cfg.expert_dim,
        intermediate_size=cfg.ffn_dim,
        decoder_sparse_step=cfg.moe_every,
        mlp_only_layers=list(range(cfg.dense_layers)),
        norm_topk_prob=cfg.router_renorm,
        use_sliding_window=False,
    )


def _moe_part(name: str) -> tuple[str, str] | None:
    """``(hf layer prefix, tetrad MoE suffix)`` of an MoE parameter name, else None."""
    parts = name.split(".")
    rest = ".".join(parts[2:])
    if len(parts) > 3 and rest.startswith("feed_forward.") and parts[3] in ("router", "experts"):
        return f"model.layers.{parts[1]}.mlp.", rest[len("feed_forward.") :]
    return None


def to_hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor], vocab: int) -> dict:
    """transformers' state dict of tetrad's full ``state`` (parameter name -> tensor; the
    selection biases of buffers are not exported: Mixtral and Qwen3-MoE have none).

    Raises:
        ModelConfigError: a parameter without a counterpart (a shared expert).
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        moe = _moe_part(name)
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
            raise ModelConfigError(f"tetrad parameter {name} has no Hugging Face counterpart")
    return out


def from_hf_state(
    cfg: ModelConfig, hf: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]
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
        moe = _moe_part(name)
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
    name: str, shape: tuple[int, ...], cfg: ModelConfig, hf: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Parameter ``name`` rebuilt from ``hf`` by inverting :func:`to_hf`'s re-layout."""
    index = torch.arange(math.prod(shape)).view(shape)
    flat = torch.zeros(math.prod(shape))
    for hf_name, where in to_hf(name, index, cfg, cfg.unpadded_vocab or cfg.vocab_size).items():
        flat[where.reshape(-1)] = hf[hf_name].reshape(-1).float()
    return flat.view(shape)
