"""The Hugging Face side of ``benchmarks/vs_transformers.py``: ``transformers.LlamaForCausalLM``
of a tetrad :class:`~tetrad.spec.model.ModelSpec`'s sizes, its training step as tetrad's
(:func:`tetrad.train.step.train_step`) steps tetrad's model, and a look at how it calls SDPA.

transformers is imported inside the functions, so that the script can say in one line that it
is missing."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.dtypes import autocast
from tetrad.parallel.batch import to_device
from tetrad.spec.model import ModelSpec

if TYPE_CHECKING:
    from transformers import LlamaConfig


def hf_config(cfg: ModelSpec, seq: int) -> LlamaConfig:
    """The ``transformers.LlamaConfig`` of ``cfg``'s sizes (positions up to ``seq``, no KV
    cache, no biases, untied LM head, fp32 weights)."""
    from transformers import LlamaConfig

    rope: dict = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_factor != 1.0:
        rope = {
            "rope_type": "llama3",
            "rope_theta": cfg.rope_theta,
            "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_positions,
        }
    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=max(seq, cfg.rope_original_positions),
        rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        use_cache=False,
        dtype=torch.float32,
    )


def config_mismatches(cfg: ModelSpec, hf: LlamaConfig) -> list[str]:
    """The sizes where the HF config ``hf`` (as built, read back) differs from ``cfg`` (empty:
    the same model)."""
    rope = getattr(hf, "rope_parameters", None) or {}
    pairs = {
        "hidden": (cfg.dim, hf.hidden_size),
        "intermediate": (cfg.ffn_dim, hf.intermediate_size),
        "heads": (cfg.n_heads, hf.num_attention_heads),
        "kv heads": (cfg.n_kv_heads, hf.num_key_value_heads),
        "head dim": (
            cfg.head_dim,
            getattr(hf, "head_dim", hf.hidden_size // hf.num_attention_heads),
        ),
        "layers": (cfg.n_layers, hf.num_hidden_layers),
        "vocabulary": (cfg.vocab_size, hf.vocab_size),
        "rope_theta": (cfg.rope_theta, rope.get("rope_theta", getattr(hf, "rope_theta", None))),
        "rms eps": (cfg.norm_eps, hf.rms_norm_eps),
        "untied embeddings": (True, not hf.tie_word_embeddings),
        "activation": ("silu", hf.hidden_act),
    }
    return [f"{k}: tetrad {a}, hf {b}" for k, (a, b) in pairs.items() if a != b]


def build_hf(cfg: ModelSpec, seq: int, device: torch.device) -> nn.Module:
    """``LlamaForCausalLM`` of :func:`hf_config`, built on ``device`` (its own initialisation)
    with SDPA attention, in training mode."""
    from transformers import LlamaForCausalLM

    with device:
        model = LlamaForCausalLM._from_config(
            hf_config(cfg, seq), attn_implementation="sdpa", dtype=torch.float32
        )
    return model.train()


def compile_layers(model: nn.Module) -> None:
    """``torch.compile`` each decoder layer of an HF Llama in place, as
    :func:`tetrad.parallel.model.compile_blocks` compiles tetrad's blocks."""
    for layer in model.model.layers:
        layer.compile()


def hf_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: torch.Tensor,
    micro_batch: int,
    device: torch.device,
    grad_clip: float,
) -> torch.Tensor:
    """One optimizer step of the HF model on the global batch ``[B, S+1]`` of token ids (inputs
    ``[:, :-1]``, targets ``[:, 1:]``) in micro-batches of ``micro_batch``, as
    :func:`tetrad.train.step.train_step` steps tetrad's: the loss is the mean cross-entropy
    (nats) over the ``B*S`` tokens from fp32 logits, the gradient norm clipped to
    ``grad_clip``. Returns the loss as a 0-dim tensor (not read: no host synchronisation)."""
    n_tokens = batch[:, 1:].numel()
    loss = torch.zeros((), device=device)
    for mb in to_device(batch, device).split(micro_batch):
        with autocast(device):
            logits = model(input_ids=mb[:, :-1], use_cache=False).logits
            part = F.cross_entropy(
                logits.flatten(0, 1).float(), mb[:, 1:].flatten(), reduction="sum"
            )
            part = part / n_tokens
        part.backward()
        loss += part.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def probe_hf_attention(model: nn.Module, vocab: int, seq: int, device: torch.device) -> dict:
    """How the HF model calls SDPA (one forward of one sample, no gradients): whether it passes
    a mask, ``is_causal`` and ``enable_gqa``. A mask would keep SDPA off the flash kernels."""
    calls: list[dict] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(
            {
                "mask": kwargs.get("attn_mask") is not None,
                "is_causal": bool(kwargs.get("is_causal", False)),
                "enable_gqa": bool(kwargs.get("enable_gqa", False)),
            }
        )
        return sdpa(*args, **kwargs)

    ids = torch.randint(0, vocab, (1, seq), device=device)
    F.scaled_dot_product_attention = spy
    try:
        with torch.no_grad(), autocast(device):
            model(input_ids=ids, use_cache=False)
    finally:
        F.scaled_dot_product_attention = sdpa
    return calls[0] | {"calls": len(calls)} if calls else {"calls": 0}
