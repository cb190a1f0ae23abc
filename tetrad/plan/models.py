"""Model sizes for the planner: presets, Hugging Face ``config.json`` files and ``key=value`` sizes.

Plain Python (no torch, nothing else from tetrad), so the planner answers instantly anywhere.

Two families:

- ``llama``: pre-norm decoder with RMSNorm (one weight vector per norm), RoPE (no position
  table), SwiGLU MLP (``w2(silu(w1 x) * w3 x)``) and grouped-query attention; no biases;
  untied LM head unless ``tied_embeddings``. This is what tetrad's runtime trains
  (:mod:`tetrad.models.llama`).
- ``gpt``: AxoNN's GPT (Megatron-LM GPT as used in Singh et al., arXiv 2305.13525 and
  2502.08145): LayerNorm with weight and bias, learned position embeddings (``max_positions``
  rows), GeLU MLP of width ``4h``, biases on every linear of the blocks, no bias on the LM head,
  untied LM head.

Parameter counts (``h`` hidden, ``L`` layers, ``a`` heads, ``k`` KV heads, ``d = h/a`` head dim,
``f`` FFN width, ``V`` vocabulary, ``P`` positions):

    llama: L (2 h (a d) + 2 h (k d) + 3 h f + 2h) + h + V h + V h (LM head, if untied)
    gpt:   L (12 h^2 + 13 h) + (V + P) h + 2h + V h (LM head)          (with f = 4h)
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, fields, replace

from tetrad.spec import TetradError

FAMILIES = ("gpt", "llama")


class PlanError(TetradError):
    """A planner input that is unknown, malformed or inconsistent; the message says what to
    change."""


@dataclass(frozen=True)
class Linear:
    """One GEMM layer ``y = x W^T (+ b)`` with ``W [out_features, in_features]`` (``[n, k]``).

    Attributes:
        name: the layer's name inside a block (``wq``, ``w2``, ``qkv``, ``output``...).
        in_features: ``k``.
        out_features: ``n``.
        transposed: AxoNN orientation. Non-transposed layers take X-sharded inputs and give
            Y-sharded outputs (stored ``[n/(G_y G_z), k/G_x]``); transposed ones the reverse
            (stored ``[n/(G_x G_z), k/G_y]``).
        count: how many such layers one block has (always 1 for the presets).
        bias: whether the layer has a bias of ``n`` elements (GPT blocks).
    """

    name: str
    in_features: int
    out_features: int
    transposed: bool
    count: int = 1
    bias: bool = False

    @property
    def weight_elements(self) -> int:
        """Elements of one weight ``n * k``."""
        return self.in_features * self.out_features

    @property
    def params(self) -> int:
        """Parameters of all ``count`` layers (weights and biases)."""
        return self.count * (self.weight_elements + (self.out_features if self.bias else 0))


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of a decoder-only transformer, as the planner needs them.

    Attributes:
        name: preset name or a label.
        family: ``"gpt"`` or ``"llama"`` (see the module docstring).
        hidden: ``h``.
        n_layers: ``L``.
        n_heads: ``a`` query heads; head dim ``h / a``.
        n_kv_heads: ``k`` key/value heads (``== a`` for GPT / multi-head attention).
        ffn_hidden: MLP inner width (GPT ``4h``; Llama its intermediate size).
        vocab: ``V`` (already padded).
        max_positions: rows of the learned position table (GPT); 0 for RoPE models.
        tied_embeddings: the LM head reuses the embedding table (no extra ``V h``).
        rope_theta: RoPE base (llama); the planner does not use it, the runtime builds its
            model from the same preset (:meth:`tetrad.models.config.ModelConfig.from_spec`).
    """

    name: str
    family: str
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab: int
    max_positions: int = 0
    tied_embeddings: bool = False
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise PlanError(f"model family {self.family!r} is unknown: use 'llama' or 'gpt'")
        for f in ("hidden", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab"):
            if int(getattr(self, f)) <= 0:
                raise PlanError(f"model size {f}={getattr(self, f)} must be a positive integer")
        if self.max_positions < 0:
            raise PlanError(f"max_positions={self.max_positions} must be >= 0")
        if self.hidden % self.n_heads:
            raise PlanError(
                f"hidden={self.hidden} is not divisible by n_heads={self.n_heads}: "
                "change one of them"
            )
        if self.n_heads % self.n_kv_heads:
            raise PlanError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}: "
                "change one of them"
            )
        if self.family == "gpt" and self.n_kv_heads != self.n_heads:
            raise PlanError("a gpt model has n_kv_heads == n_heads: drop n_kv_heads")

    # ---- sizes -------------------------------------------------------------------------------

    @property
    def head_dim(self) -> int:
        """``d = h / a``."""
        return self.hidden // self.n_heads

    @property
    def q_dim(self) -> int:
        """Width of the query projection ``a * d`` (equals ``h``)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of one of the key or value projections ``k * d``."""
        return self.n_kv_heads * self.head_dim

    def linears(self) -> list[Linear]:
        """The GEMM layers of ONE block, in execution order.

        llama: ``wq`` (h->a d), ``wk``, ``wv`` (h->k d), ``wo`` (a d->h, transposed), ``w1``,
        ``w3`` (h->f), ``w2`` (f->h, transposed). gpt: ``qkv`` (h->3h), ``proj`` (h->h,
        transposed), ``fc1`` (h->4h), ``fc2`` (4h->h, transposed), all with biases.
        """
        h, f = self.hidden, self.ffn_hidden
        if self.family == "gpt":
            return [
                Linear("qkv", h, 3 * self.q_dim, False, bias=True),
                Linear("proj", self.q_dim, h, True, bias=True),
                Linear("fc1", h, f, False, bias=True),
                Linear("fc2", f, h, True, bias=True),
            ]
        return [
            Linear("wq", h, self.q_dim, False),
            Linear("wk", h, self.kv_dim, False),
            Linear("wv", h, self.kv_dim, False),
            Linear("wo", self.q_dim, h, True),
            Linear("w1", h, f, False),
            Linear("w3", h, f, False),
            Linear("w2", f, h, True),
        ]

    def lm_head(self) -> Linear:
        """The LM head ``output`` (h->V, non-transposed, no bias): logits come out Y-sharded."""
        return Linear("output", self.hidden, self.vocab, False)

    def norm_params(self) -> int:
        """Parameters of one norm: RMSNorm ``h`` (weight), LayerNorm ``2h`` (weight, bias)."""
        return 2 * self.hidden if self.family == "gpt" else self.hidden

    def params_per_layer(self) -> int:
        """Parameters of one block: its linears (with biases) and its two norms."""
        return sum(lin.params for lin in self.linears()) + 2 * self.norm_params()

    def embedding_params(self) -> int:
        """Token table ``V h`` plus the learned position table ``P h`` (GPT)."""
        return (self.vocab + self.max_positions) * self.hidden

    def lm_head_params(self) -> int:
        """``V h`` for an untied LM head, 0 when tied to the embedding."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    def num_params(self) -> int:
        """Exact total parameter count."""
        return (
            self.n_layers * self.params_per_layer()
            + self.embedding_params()
            + self.norm_params()
            + self.lm_head_params()
        )

    def matmul_params(self) -> int:
        """Weights used in a GEMM per token: block linears (no biases) and the LM head (the
        embedding lookup is not a GEMM)."""
        block = sum(lin.count * lin.weight_elements for lin in self.linears())
        return self.n_layers * block + self.vocab * self.hidden

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, forward + backward, no recomputation:
        ``6 * matmul_params + 6 * L * S * (a d)``.

        The PaLM estimate (Chowdhery et al. 2022, appendix B, ``6N + 12 L H Q T``) with the
        attention term halved for causal masking; the same rule as
        ``tetrad.models.config.ModelConfig.flops_per_token``.
        """
        return 6.0 * self.matmul_params() + 6.0 * self.n_layers * seq_len * self.q_dim

    def summary(self) -> str:
        """One line: name, family, billions of parameters and the sizes."""
        return (
            f"{self.name} ({self.family}, {self.num_params() / 1e9:.2f}B): h={self.hidden} "
            f"L={self.n_layers} heads={self.n_heads}/{self.n_kv_heads} "
            f"ffn={self.ffn_hidden} V={self.vocab}"
        )


# ---- presets ---------------------------------------------------------------------------------

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
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
    )


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
    holding one), or ``key=value`` sizes; a preset or path may be followed by overrides.

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
