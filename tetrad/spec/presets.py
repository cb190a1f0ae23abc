"""Named models and how ``--model`` is read: one preset table and one parser for ``tetrad
train``, ``plan``, ``memory``, ``generate`` and configuration files. Plain Python.

A model is a preset name (:data:`PRESETS`), a Hugging Face ``config.json`` path (or a folder
holding one, also written ``hf:FOLDER``; :mod:`tetrad.spec.hf_config`), or ``key=value`` sizes,
and a preset or path may be followed by ``key=value`` overrides: ``small,n_layers=8``,
``llama-3.1-8b,n_layers=16``, ``dim=4096,n_layers=32,n_heads=32,n_kv_heads=8,ffn_dim=14336,
vocab_size=128256``. The keys are :class:`tetrad.spec.model.ModelSpec`'s fields; the
planner's former spellings (``hidden``, ``ffn_hidden``, ``vocab``, ``expert_ffn``,
``shared_ffn``) and the Hugging Face names are accepted as aliases (:data:`ALIASES`).
"""

from __future__ import annotations

import difflib
import os
from dataclasses import fields, replace

from tetrad.spec.conflicts import Settings, check_conflicts
from tetrad.spec.hf_config import from_hf_config
from tetrad.spec.model import ModelError, ModelSpec

GPT_VOCAB = 51200
"""GPT-2 BPE (50,257 tokens) padded to 51,200, Megatron-LM's default padding
(``--make-vocab-size-divisible-by 128`` times TP 8 = multiples of 1024)."""
GPT_MAX_POSITIONS = 2048
"""Learned positions of AxoNN's GPT runs (``--max-position-embeddings 2048``, sequence 2048)."""


def _gpt(name: str, n_layers: int, dim: int, n_heads: int) -> ModelSpec:
    return ModelSpec(
        name, "gpt", dim, n_layers, n_heads, n_heads, 4 * dim, GPT_VOCAB, GPT_MAX_POSITIONS
    )


def _llama(
    name: str,
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    ffn: int,
    vocab: int,
    rope_theta: float = 10000.0,
) -> ModelSpec:
    return ModelSpec(
        name, "llama", dim, n_layers, n_heads, n_kv_heads, ffn, vocab, rope_theta=rope_theta
    )


LLAMA3_THETA = 500000.0
"""RoPE base of Llama 3 and 3.1 (Hugging Face configs, ``rope_theta``); Llama 2 uses 10,000."""


_TETRAD = [
    # For tests: every size divisible by 2 on every axis (and by 8 where it matters).
    ModelSpec("tiny", "llama", 64, 2, 4, 2, 128, 256),
    # For the demo: a few million parameters, trains on 2 CPU cores in minutes.
    ModelSpec("small", "llama", 256, 4, 8, 4, 768, 4096),
    ModelSpec("medium", "llama", 512, 8, 8, 4, 1536, 4096),
    # MoE for tests: 4 experts, top-2, a shared expert, block 0 dense.
    ModelSpec(
        "moe-tiny",
        "llama",
        64,
        2,
        4,
        2,
        128,
        256,
        n_experts=4,
        top_k=2,
        expert_ffn_dim=32,
        shared_ffn_dim=32,
        dense_layers=1,
        aux_loss_coef=0.01,
    ),
    # MoE for the CPU demo: the active parameters of `small` (8 experts of width 384, top-2:
    # each token runs 2 x 3 x 256 x 384 = 589,824 expert weights per block, `small`'s
    # 3 x 256 x 768; plus a 2,048-weight router). 5,253,376 active, 12,331,264 in all
    # (`small`: 5,245,184). Balancing: the load-balancing loss at 0.01 and DeepSeek-V3's
    # selection-bias update at 0.003 per step (chosen from measured 300-step curves on the demo
    # corpus, two seeds, docs/moe.md: each block's load averaged over steps 151-300 goes from
    # 1.07-1.54 to 1.01-1.02 of the mean, the steps after step 100 at or above 1.3 from 76-199
    # to 31-54 of 200 per block (0.01: 62-113), validation loss within the seeds' spread).
    ModelSpec(
        "moe-small",
        "llama",
        256,
        4,
        8,
        4,
        768,
        4096,
        n_experts=8,
        top_k=2,
        expert_ffn_dim=384,
        aux_loss_coef=0.01,
        bias_update_rate=0.003,
    ),
]

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
    # tetrad's 1B Llama for a single GPU.
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
        expert_ffn_dim=14336,
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
        expert_ffn_dim=768,
    ),
    # Qwen3-235B-A22B (Hugging Face Qwen/Qwen3-235B-A22B config.json: hidden_size 4096,
    # num_hidden_layers 94, num_attention_heads 64, num_key_value_heads 4, head_dim 128,
    # num_experts 128, num_experts_per_tok 8, moe_intermediate_size 1536, vocab_size 151936,
    # rope_theta 1e6, rms_norm_eps 1e-6, norm_topk_prob true, decoder_sparse_step 1,
    # mlp_only_layers [], router_aux_loss_coef 0.001, untied): 235.09B, 22.2B active; q/k norms
    # (qk_norm) not counted (2 x 128 per block); intermediate_size 12288 is unused.
    ModelSpec(
        "qwen3-235b-a22b",
        "llama",
        4096,
        94,
        64,
        4,
        12288,
        151936,
        rope_theta=1e6,
        norm_eps=1e-6,
        attn_head_dim=128,
        qk_norm=True,
        n_experts=128,
        top_k=8,
        expert_ffn_dim=1536,
        aux_loss_coef=0.001 * 8 / 94,  # transformers pools 94 blocks' loss (aux_coef_from_hf)
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
        expert_ffn_dim=2048,
        shared_ffn_dim=2048,
        dense_layers=3,
        kv_lora_rank=512,
        q_lora_rank=1536,
        rope_head_dim=64,
        v_head_dim=128,
    ),
]
PRESETS: dict[str, ModelSpec] = {m.name: m for m in _TETRAD + _PRESET_LIST}
"""Every named model: tetrad's own (``tiny``, ``small``, ``medium``, ``moe-tiny``,
``moe-small``) and the published sizes. A preset's ``vocab_size`` is what the planner assumes;
a training run takes the vocabulary from its tokenizer unless the user sets ``vocab_size``
(``TrainConfig.model_config``). ``tetrad train`` refuses the presets its Llama does not
implement (:func:`tetrad.spec.model.check_trainable`)."""

ALIASES = {
    "hidden": "dim",
    "hidden_size": "dim",
    "h": "dim",
    "layers": "n_layers",
    "num_hidden_layers": "n_layers",
    "num_layers": "n_layers",
    "heads": "n_heads",
    "num_attention_heads": "n_heads",
    "kv_heads": "n_kv_heads",
    "num_key_value_heads": "n_kv_heads",
    "ffn_hidden": "ffn_dim",
    "intermediate_size": "ffn_dim",
    "ffn": "ffn_dim",
    "vocab": "vocab_size",
    "max_position_embeddings": "max_positions",
    "tie_word_embeddings": "tied_embeddings",
    "rms_norm_eps": "norm_eps",
    "expert_ffn": "expert_ffn_dim",
    "moe_intermediate_size": "expert_ffn_dim",
    "shared_ffn": "shared_ffn_dim",
    "num_experts": "n_experts",
    "num_local_experts": "n_experts",
    "num_experts_per_tok": "top_k",
}
"""Other accepted spellings of the size keys: the planner's former names and Hugging Face's."""

SIZE_KEYS = tuple(f.name for f in fields(ModelSpec) if f.name != "name")
"""The size keys ``--model`` takes (every field of :class:`ModelSpec` but ``name``)."""

_TYPES = {f.name: f.type for f in fields(ModelSpec)}


def _near(word: str, choices) -> str:
    near = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def _parse_value(key: str, value):
    """``value`` (text, or a number or bool from a TOML file) as ``key``'s type.

    Raises:
        ModelError: a value that is not of the key's type.
    """
    kind = _TYPES[key]
    text = str(value).strip()
    try:
        if kind == "bool":
            if isinstance(value, bool | int):
                return bool(value)
            low = text.lower()
            if low not in ("1", "true", "yes", "0", "false", "no"):
                raise ValueError(value)
            return low in ("1", "true", "yes")
        if kind == "float":
            return float(value)
        if kind == "str":
            return text.lower() if key == "family" else text
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return int(text.replace("_", "")) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        what = {"bool": "true or false", "float": "a number", "int": "an integer"}.get(kind, kind)
        raise ModelError(f"model size {key}={value!r} is not {what}") from None


def with_sizes(base: ModelSpec, sizes: dict) -> ModelSpec:
    """``base`` with the given sizes replaced (keys may be aliases, values text or numbers); the
    name records the overrides (``small,n_layers=8``).

    Raises:
        ModelError: an unknown key (naming the nearest known one) or a value of the wrong type.
    """
    if not sizes:
        return base
    parsed = _sizes(sizes)
    extra = ",".join(f"{k}={v}" for k, v in sizes.items() if k != "name")
    name = parsed.pop("name", f"{base.name},{extra}" if extra else base.name)
    return replace(base, name=name, **parsed)


def _sizes(sizes: dict) -> dict:
    """``sizes`` with aliases resolved and values parsed (:func:`with_sizes`)."""
    out: dict = {}
    for key, value in sizes.items():
        key = ALIASES.get(str(key).strip(), str(key).strip())
        if key == "name":
            out["name"] = str(value)
            continue
        if key not in SIZE_KEYS:
            raise ModelError(
                f"unknown model size {key!r}{_near(key, [*SIZE_KEYS, *ALIASES])}: known sizes "
                f"are {', '.join(SIZE_KEYS)}"
            )
        out[key] = _parse_value(key, value)
    return out


def _from_sizes(sizes: dict) -> ModelSpec:
    """A model from ``key=value`` sizes alone: ``dim``, ``n_layers``, ``n_heads`` and
    ``ffn_dim`` given (``n_kv_heads`` defaults to ``n_heads``, ``vocab_size`` to 0: not known
    yet, a training run takes it from its tokenizer); family ``gpt`` defaults ``ffn_dim`` to
    ``4 dim``, its vocabulary and its positions.

    Raises:
        ModelError: a missing size.
    """
    parsed = _sizes(sizes)
    defaults: dict = {"name": "custom", "family": parsed.get("family", "llama")}
    if defaults["family"] == "gpt":
        defaults |= {"max_positions": GPT_MAX_POSITIONS, "vocab_size": GPT_VOCAB}
        if "dim" in parsed:
            defaults["ffn_dim"] = 4 * parsed["dim"]
    if "n_heads" in parsed:
        defaults["n_kv_heads"] = parsed["n_heads"]
    spec = defaults | parsed
    missing = [k for k in ("dim", "n_layers", "n_heads", "ffn_dim") if k not in spec]
    if missing:
        raise ModelError(
            f"model sizes lack {', '.join(missing)}: give them as key=value "
            "(for example dim=4096,n_layers=32,n_heads=32,ffn_dim=14336,vocab_size=128256) "
            "or start from a preset (small,n_layers=8)"
        )
    return ModelSpec(**spec)


def parse_model(text: str) -> tuple[ModelSpec, frozenset[str]]:
    """Read ``--model`` (see the module docstring) into the model and the size keys given
    explicitly (aliases resolved).

    Raises:
        ModelError: unknown preset (with the closest name), unknown key, bad value, missing
            sizes, an unreadable config.json.
        ConflictError: mixture-of-experts sizes with ``n_experts=0``.
    """
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise ModelError(
            f"no model given: use a preset ({', '.join(PRESETS)}), a config.json "
            "path or sizes like dim=4096,n_layers=32,..."
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
            raise ModelError(
                f"unknown model {first!r}{_near(first, PRESETS)}: use one of "
                f"{', '.join(PRESETS)}, a config.json path or key=value sizes"
            )
    sizes: dict = {}
    for p in parts:
        if "=" not in p:
            raise ModelError(f"model size {p!r} is not key=value (for example n_layers=8)")
        key, value = (s.strip() for s in p.split("=", 1))
        sizes[key] = value
    model = _from_sizes(sizes) if base is None else with_sizes(base, sizes)
    explicit = frozenset(ALIASES.get(k, k) for k in sizes)
    check_conflicts(Settings(model=model, model_keys=explicit))
    return model, explicit


def get_model(text: str) -> ModelSpec:
    """:func:`parse_model`'s model, whose vocabulary must be known (what the planner needs).

    Raises:
        ModelError: as :func:`parse_model`, or sizes without ``vocab_size``.
    """
    model = parse_model(text)[0]
    if model.vocab_size < 1:
        raise ModelError(
            f"model {text!r} has no vocab_size: give vocab_size=N (the planner cannot take it "
            "from a tokenizer)"
        )
    return model
