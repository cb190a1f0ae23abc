"""Hugging Face Mixtral and Qwen3-MoE folders: sizes from ``config.json``, expert weights in and
out of tetrad's layout (:mod:`tetrad.models.hf` reads and writes the rest, and calls in here).

Folders keep the Hub's per-expert tensors (transformers 5 writes them so and fuses them into
``mlp.experts.gate_up_proj [E, 2F, h]`` / ``down_proj [E, h, F]`` when loading; the fused state
dicts: :mod:`tetrad.models.hf_moe_state`). Names, beyond the Llama ones (``L`` a block, ``j`` an
expert, ``P`` = ``block_sparse_moe`` for Mixtral and ``mlp`` for Qwen3-MoE)::

    layers.L.feed_forward.router.gate.weight  [E, h]    model.layers.L.P.gate.weight
    layers.L.feed_forward.experts.w1          [E, F, h] model.layers.L.P.experts.j.w1.weight
                                                        (Qwen3: .gate_proj.weight), [F, h] each
    layers.L.feed_forward.experts.w3          [E, F, h] ...experts.j.w3.weight (.up_proj)
    layers.L.feed_forward.experts.w2          [E, h, F] ...experts.j.w2.weight (.down_proj)
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

from collections.abc import Callable

import torch

from tetrad.spec.hf_config import ARCHITECTURES, aux_coef_to_hf
from tetrad.spec.model import ModelError, ModelSpec


def moe_hf_config(cfg: ModelSpec, kind: str, vocab: int) -> dict:
    """The ``config.json`` (a dict) of ``cfg`` as a ``kind`` model (``mixtral`` or
    ``qwen3_moe``), fp32, untied embeddings.

    Raises:
        ModelError: ``cfg`` is not expressible in that family (a shared expert, a sigmoid
            router, route scaling, a selection bias; Mixtral: dense blocks or no
            renormalisation; Qwen3: no q/k norm).
    """
    bad = cfg.shared_ffn_dim or cfg.router_score != "softmax" or cfg.route_scale != 1.0
    bad = bad or cfg.bias_update_rate > 0  # a selection bias neither family has
    if kind == "mixtral":
        bad = bad or cfg.moe_layers != cfg.n_layers or not cfg.router_renorm or cfg.qk_norm
    elif kind == "qwen3_moe":
        bad = bad or not cfg.qk_norm
    if bad or kind not in ARCHITECTURES or not cfg.is_moe:
        raise ModelError(
            f"this model has no {kind} equivalent in transformers (Mixtral: softmax router, "
            "renormalised, every block MoE; Qwen3-MoE: q/k norms; neither has shared experts, "
            "route scaling or selection biases): export it as safetensors"
        )
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
        router_aux_loss_coef=aux_coef_to_hf(cfg),  # transformers pools the blocks' loss
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


def hub_kind(cfg: ModelSpec) -> str:
    """The family an MoE ``cfg`` is written as: ``qwen3_moe`` with q/k norms, else
    ``mixtral``."""
    return "qwen3_moe" if cfg.qk_norm else "mixtral"


_BLOCK = {"mixtral": "block_sparse_moe", "qwen3_moe": "mlp"}
_EXPERT = {
    "mixtral": {"w1": "w1", "w2": "w2", "w3": "w3"},
    "qwen3_moe": {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"},
}


def moe_part(name: str) -> tuple[str, str] | None:
    """``(block index, what)`` of an MoE parameter name (``what``: ``router.gate.weight`` or
    ``experts.w1`` / ``w2`` / ``w3``), None for any other name."""
    parts = name.split(".")
    if len(parts) > 3 and parts[2] == "feed_forward" and parts[3] in ("router", "experts"):
        return parts[1], ".".join(parts[3:])
    return None


def _hub_names(cfg: ModelSpec, layer: str, what: str) -> list[str]:
    """The Hub tensors of tetrad's MoE parameter ``what`` in block ``layer`` (one per expert
    for the expert weights).

    Raises:
        ModelError: a parameter without a counterpart (a router bias).
    """
    kind = hub_kind(cfg)
    prefix = f"model.layers.{layer}.{_BLOCK[kind]}."
    if what == "router.gate.weight":
        return [prefix + "gate.weight"]
    if what.startswith("experts.w") and what[-2:] in _EXPERT[kind]:
        own = _EXPERT[kind][what[-2:]]
        return [f"{prefix}experts.{j}.{own}.weight" for j in range(cfg.n_experts)]
    raise ModelError(
        f"tetrad parameter layers.{layer}.feed_forward.{what} has no Hugging Face counterpart"
    )


def moe_to_hub(name: str, full: torch.Tensor, cfg: ModelSpec) -> dict | None:
    """The Hub tensors of tetrad's full MoE parameter ``name`` (expert ``j`` of ``[E, ...]``
    is ``full[j]``); None when ``name`` is not an MoE parameter."""
    part = moe_part(name)
    if part is None:
        return None
    names = _hub_names(cfg, *part)
    if len(names) == 1:
        return {names[0]: full}
    return dict(zip(names, full.unbind(0), strict=True))


def read_moe(
    read: Callable[[str, slice, slice], torch.Tensor],
    name: str,
    slices: tuple[slice, ...],
    cfg: ModelSpec,
) -> torch.Tensor | None:
    """tetrad's MoE parameter ``name`` restricted to ``slices``, read through ``read(hub name,
    rows, cols)`` (one expert's rows and columns at a time); None when ``name`` is not an MoE
    parameter."""
    part = moe_part(name)
    if part is None:
        return None
    names = _hub_names(cfg, *part)
    if len(names) == 1:
        return read(names[0], slices[0], slices[1])
    experts = range(slices[0].start, slices[0].stop)
    return torch.stack([read(names[j], slices[1], slices[2]) for j in experts])
