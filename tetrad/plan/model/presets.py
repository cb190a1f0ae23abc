"""Named models for the planner: presets, Hugging Face ``config.json`` files and ``key=value``
sizes (:func:`get_model`; the Hugging Face reader is :mod:`tetrad.plan.model.hf_config`). Plain
Python.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import fields, replace

from tetrad.plan.errors import PlanError
from tetrad.plan.model.hf_config import from_hf_config
from tetrad.plan.model.spec import ModelSpec

GPT_VOCAB = 51200
"""GPT-2 BPE (50,257 tokens) padded to 51,200, Megatron-LM's default padding
(``--make-vocab-size-divisible-by 128`` times TP 8 = multiples of 1024)."""
GPT_MAX_POSITIONS = 2048
"""Learned positions of AxoNN's GPT runs (``--max-position-embeddings 2048``, sequence 2048)."""


def _gpt(name: str, n_layers: int, hidden: int, n_heads: int) -> ModelSpec:
    return ModelSpec(
        name, "gpt", hidden, n_layers, n_heads, n_heads, 4 * hidden, GPT_VOCAB, GPT_MAX_POSITIONS
    )


def _llama(
    name: str,
    hidden: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    ffn: int,
    vocab: int,
    rope_theta: float = 10000.0,
) -> ModelSpec:
    return ModelSpec(
        name, "llama", hidden, n_layers, n_heads, n_kv_heads, ffn, vocab, rope_theta=rope_theta
    )


LLAMA3_THETA = 500000.0
"""RoPE base of Llama 3 and 3.1 (Hugging Face configs, ``rope_theta``); Llama 2 uses 10,000."""


_PRESET_LIST = [
    # AxoNN's GPT family (Megatron-AxoNN model table; 160B-640B from arXiv 2502.08145).
    _gpt("gpt-5b", 24, 4096, 32),
    _gpt("gpt-10b", 32, 5120, 40),
    _gpt("gpt-20b", 32, 7168, 56),
    _gpt("gpt-40b", 38, 9216, 72),
    _gpt("gpt-60b", 56, 9216, 72),
    _gpt("gpt-80b", 42, 12288, 96),
    _gpt("gpt-160b", 84, 12288, 96),
    _gpt("gpt-320b", 96, 16384, 128),
    _gpt("gpt-640b", 192, 16384, 128),
    # T3's evaluation models (Pati et al., arXiv 2401.16677): Megatron-LM's 8.3B GPT-2
    # (Shoeybi et al., arXiv 1909.08053, Table 2) and Microsoft's Turing-NLG 17B (78 layers,
    # hidden 4256, 28 heads).
    _gpt("mega-gpt-2", 72, 3072, 32),
    _gpt("t-nlg", 78, 4256, 28),
    # Llama 2 (Touvron et al., arXiv 2307.09288; Hugging Face configs).
    _llama("llama-2-7b", 4096, 32, 32, 32, 11008, 32000),
    _llama("llama-2-13b", 5120, 40, 40, 40, 13824, 32000),
    _llama("llama-2-70b", 8192, 80, 64, 8, 28672, 32000),
    # Llama 3 / 3.1 (Grattafiori et al., arXiv 2407.21783, table 3; Hugging Face configs).
    _llama("llama-3-8b", 4096, 32, 32, 8, 14336, 128256, LLAMA3_THETA),
    _llama("llama-3-70b", 8192, 80, 64, 8, 28672, 128256, LLAMA3_THETA),
    _llama("llama-3.1-8b", 4096, 32, 32, 8, 14336, 128256, LLAMA3_THETA),
    _llama("llama-3.1-70b", 8192, 80, 64, 8, 28672, 128256, LLAMA3_THETA),
    _llama("llama-3.1-405b", 16384, 126, 128, 8, 53248, 128256, LLAMA3_THETA),
    # tetrad's 1B Llama for a single GPU (the runtime's preset too: every llama preset here is
    # one `tetrad train --model` accepts).
    _llama("llama-1b", 2048, 16, 32, 8, 8192, 32768, LLAMA3_THETA),
    # Mixtures of experts (config.json values; docs: /work/shared/notes section 3). Mixtral
    # 8x7B (Jiang et al., arXiv 2401.04088): every block 8 experts of 14336, top-2.
    ModelSpec(
        "mixtral-8x7b",
        "llama",
        4096,
        32,
        32,
        8,
        14336,
        32000,
        rope_theta=1e6,
        n_experts=8,
        top_k=2,
        expert_ffn=14336,
    ),
    # Qwen3-30B-A3B: 128 experts of 768, top-8, heads of 128 (h/a = 64); q/k norms not counted
    # (2 x 128 per block). intermediate_size 6144 is unused (no dense block).
    ModelSpec(
        "qwen3-30b-a3b",
        "llama",
        2048,
        48,
        32,
        4,
        6144,
        151936,
        rope_theta=1e6,
        attn_head_dim=128,
        n_experts=128,
        top_k=8,
        expert_ffn=768,
    ),
    # DeepSeek-V3 (arXiv 2412.19437; inference/configs/config_671B.json): MLA attention, the
    # first 3 blocks dense (18432), then 256 experts of 2048, top-8, one shared expert of
    # 2048; the multi-token-prediction module is not counted (671B, 37B active).
    ModelSpec(
        "deepseek-v3",
        "llama",
        7168,
        61,
        128,
        128,
        18432,
        129280,
        attn_head_dim=128,
        n_experts=256,
        top_k=8,
        expert_ffn=2048,
        shared_ffn=2048,
        dense_layers=3,
        kv_lora_rank=512,
        q_lora_rank=1536,
        rope_head_dim=64,
        v_head_dim=128,
    ),
]
PRESETS: dict[str, ModelSpec] = {m.name: m for m in _PRESET_LIST}

# Accepted spellings of the size keys: tetrad's ModelConfig names and Hugging Face names.
_ALIASES = {
    "dim": "hidden",
    "hidden_size": "hidden",
    "h": "hidden",
    "layers": "n_layers",
    "num_hidden_layers": "n_layers",
    "num_layers": "n_layers",
    "heads": "n_heads",
    "num_attention_heads": "n_heads",
    "kv_heads": "n_kv_heads",
    "num_key_value_heads": "n_kv_heads",
    "ffn_dim": "ffn_hidden",
    "intermediate_size": "ffn_hidden",
    "ffn": "ffn_hidden",
    "vocab_size": "vocab",
    "max_position_embeddings": "max_positions",
    "tie_word_embeddings": "tied_embeddings",
}
_SIZE_KEYS = [f.name for f in fields(ModelSpec) if f.name != "name"]


def _near(word: str, choices) -> str:
    near = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def _parse_value(key: str, value: str):
    if key == "family":
        return value.lower()
    if key == "rope_theta":
        try:
            return float(value)
        except ValueError:
            raise PlanError(f"model size rope_theta={value!r} is not a number") from None
    if key == "tied_embeddings":
        low = value.lower()
        if low in ("1", "true", "yes"):
            return True
        if low in ("0", "false", "no"):
            return False
        raise PlanError(f"model size tied_embeddings={value!r} is not true or false")
    try:
        return int(value.replace("_", ""))
    except ValueError:
        raise PlanError(f"model size {key}={value!r} is not an integer") from None


def _from_sizes(base: ModelSpec | None, sizes: dict) -> ModelSpec:
    if base is not None:
        out = replace(base, **sizes)
        if sizes and "name" not in sizes:
            extra = ",".join(f"{k}={v}" for k, v in sizes.items())
            out = replace(out, name=f"{base.name},{extra}")
        return out
    family = sizes.get("family", "llama")
    defaults: dict = {
        "name": "custom",
        "family": family,
        "max_positions": 0,
        "tied_embeddings": False,
    }
    if family == "gpt":
        defaults["max_positions"] = GPT_MAX_POSITIONS
        defaults["vocab"] = GPT_VOCAB
        if "hidden" in sizes:
            defaults["ffn_hidden"] = 4 * sizes["hidden"]
    if "n_heads" in sizes:
        defaults["n_kv_heads"] = sizes["n_heads"]
    spec = {**defaults, **sizes}
    missing = [k for k in ("hidden", "n_layers", "n_heads", "ffn_hidden", "vocab") if k not in spec]
    if missing:
        raise PlanError(
            f"model sizes lack {', '.join(missing)}: give them as key=value "
            "(for example hidden=4096,n_layers=32,n_heads=32,ffn_hidden=14336,"
            "vocab=128256) or start from a preset"
        )
    return ModelSpec(**spec)


def get_model(text: str) -> ModelSpec:
    """Resolve a model given as a preset name, a Hugging Face ``config.json`` path (or a folder
    holding one, also written ``hf:FOLDER``), or ``key=value`` sizes; a preset or path may be
    followed by overrides.

    Examples: ``llama-3.1-70b``, ``path/to/config.json``, ``llama-3-8b,n_layers=16``,
    ``hidden=4096,n_layers=32,n_heads=32,n_kv_heads=8,ffn_hidden=14336,vocab=128256``
    (family llama unless ``family=gpt``). Keys: ``family hidden n_layers n_heads n_kv_heads
    ffn_hidden vocab max_positions tied_embeddings`` (tetrad's ``dim ffn_dim vocab_size`` and
    the Hugging Face names are accepted too).

    Raises:
        PlanError: unknown preset (with the closest name), unknown key, bad value, missing sizes.
    """
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise PlanError(
            f"no model given: use a preset ({', '.join(PRESETS)}), a config.json "
            "path or sizes like hidden=4096,n_layers=32,..."
        )
    base = None
    if "=" not in parts[0]:
        first = parts.pop(0)
        if first in PRESETS:
            base = PRESETS[first]
        elif first.startswith("hf:"):
            base = from_hf_config(first[3:])
        elif first.endswith(".json") or os.path.sep in first or os.path.exists(first):
            base = from_hf_config(first)
        else:
            raise PlanError(
                f"unknown model {first!r}{_near(first, PRESETS)}: use one of "
                f"{', '.join(PRESETS)}, a config.json path or key=value sizes"
            )
    sizes: dict = {}
    for p in parts:
        if "=" not in p:
            raise PlanError(f"model size {p!r} is not key=value (for example n_layers=32)")
        key, value = (s.strip() for s in p.split("=", 1))
        key = _ALIASES.get(key, key)
        if key == "name":
            sizes["name"] = value
            continue
        if key not in _SIZE_KEYS:
            raise PlanError(
                f"unknown model size {key!r}{_near(key, _SIZE_KEYS)}: known sizes "
                f"are {', '.join(_SIZE_KEYS)}"
            )
        sizes[key] = _parse_value(key, value)
    return _from_sizes(base, sizes)
