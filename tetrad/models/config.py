"""Llama model sizes: presets, user-given sizes, and divisibility checks against a grid."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass


class ModelConfigError(ValueError):
    """A model size that is unknown, malformed or not divisible by the grid."""


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of a Llama-architecture decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention).

    Attributes:
        dim: hidden size ``h``.
        n_layers: transformer blocks.
        n_heads: query heads; ``head_dim = dim // n_heads``.
        n_kv_heads: key/value heads (grouped-query attention); divides ``n_heads``.
        ffn_dim: SwiGLU inner size.
        vocab_size: tokens in the vocabulary (0 means: take it from the tokenizer).
        rope_theta: RoPE base.
        norm_eps: RMSNorm epsilon.
    """

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 768
    vocab_size: int = 0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Total parameter count (embedding and LM head untied)."""
        h, kv = self.dim, self.n_kv_heads * self.head_dim
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * self.ffn_dim + 2 * h
        return self.n_layers * per_layer + 2 * self.vocab_size * h + h

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward, no recomputation).

        ``6 * N_matmul + 6 * L * S * h``: the PaLM estimate (Chowdhery et al. 2022, appendix B,
        ``6N + 12 L H Q T``) with the attention term halved for causal masking. ``N_matmul`` counts
        every weight used in a GEMM (the LM head included, the embedding lookup excluded).
        """
        norms = (2 * self.n_layers + 1) * self.dim
        n_matmul = self.num_params() - self.vocab_size * self.dim - norms
        return 6.0 * n_matmul + 6.0 * self.n_layers * seq_len * self.dim


PRESETS: dict[str, ModelConfig] = {
    # For tests: every size divisible by 2 on every axis (and by 8 where it matters).
    "tiny": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256),
    # For the demo: a few million parameters, trains on 2 CPU cores in minutes.
    "small": ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768),
    "medium": ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1536),
    "llama-1b": ModelConfig(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        vocab_size=32768,
        rope_theta=500000.0,
    ),
}


def parse_model(text: str) -> ModelConfig:
    """Parse ``"PRESET"``, ``"PRESET,key=value,..."`` or ``"key=value,..."`` (on ``small``).

    Example: ``small,n_layers=8`` or ``dim=512,n_heads=8,n_kv_heads=2,ffn_dim=1536``.

    Raises:
        ModelConfigError: unknown preset or key, or a value that is not a number.
    """
    parts = [p.strip() for p in text.split(",") if p.strip()]
    base = PRESETS["small"]
    if parts and "=" not in parts[0]:
        name = parts.pop(0)
        if name not in PRESETS:
            near = difflib.get_close_matches(name, PRESETS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ModelConfigError(
                f"unknown model {name!r}{hint}: use one of {', '.join(PRESETS)} "
                "or sizes like dim=256,n_layers=4"
            )
        base = PRESETS[name]
    sizes: dict[str, str] = {}
    for p in parts:
        if "=" not in p:
            raise ModelConfigError(f"model size {p!r} is not key=value (for example n_layers=8)")
        k, v = p.split("=", 1)
        sizes[k.strip()] = v.strip()
    return with_sizes(base, sizes)


def with_sizes(base: ModelConfig, sizes: dict) -> ModelConfig:
    """Return ``base`` with the given fields replaced (values may be strings).

    Raises:
        ModelConfigError: an unknown field name or a value of the wrong type.
    """
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    out = {}
    for k, v in sizes.items():
        if k not in fields:
            near = difflib.get_close_matches(k, fields, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ModelConfigError(
                f"unknown model size {k!r}{hint}: known sizes are {', '.join(fields)}"
            )
        kind = float if fields[k].type in ("float", float) else int
        try:
            out[k] = kind(v)
        except (TypeError, ValueError):
            raise ModelConfigError(f"model size {k}={v!r} is not a {kind.__name__}") from None
    return dataclasses.replace(base, **out)


def check_divisible(cfg: ModelConfig, grid: tuple[int, int, int, int]) -> None:
    """Check that every weight of ``cfg`` can be sharded on ``grid = (G_data, G_z, G_y, G_x)``.

    Non-transposed weights ``[n, k]`` need ``n % (G_y*G_z) == 0`` and ``k % G_x == 0``;
    transposed ones the same with X and Y swapped; attention needs whole heads per Y rank.

    Raises:
        ModelConfigError: one line listing every size that does not divide, and what to change.
    """
    _, gz, gy, gx = grid
    hd = cfg.head_dim
    checks = [
        (cfg.dim % cfg.n_heads == 0, f"dim={cfg.dim} divisible by n_heads={cfg.n_heads}"),
        (
            cfg.n_heads % cfg.n_kv_heads == 0,
            f"n_heads={cfg.n_heads} divisible by n_kv_heads={cfg.n_kv_heads}",
        ),
        (cfg.n_heads % gy == 0, f"n_heads={cfg.n_heads} divisible by G_y={gy}"),
        (cfg.n_kv_heads % gy == 0, f"n_kv_heads={cfg.n_kv_heads} divisible by G_y={gy}"),
        (cfg.dim % (gx * gz) == 0, f"dim={cfg.dim} divisible by G_x*G_z={gx * gz}"),
        (
            (cfg.n_kv_heads * hd) % (gy * gz) == 0,
            f"n_kv_heads*head_dim={cfg.n_kv_heads * hd} divisible by G_y*G_z={gy * gz}",
        ),
        (
            (cfg.n_heads * hd) % (gy * gz) == 0,
            f"n_heads*head_dim={cfg.n_heads * hd} divisible by G_y*G_z={gy * gz}",
        ),
        (cfg.ffn_dim % (gy * gz) == 0, f"ffn_dim={cfg.ffn_dim} divisible by G_y*G_z={gy * gz}"),
        (
            cfg.vocab_size % (gy * gz) == 0,
            f"vocab_size={cfg.vocab_size} divisible by G_y*G_z={gy * gz}",
        ),
    ]
    bad = [msg for ok, msg in checks if not ok]
    if bad:
        raise ModelConfigError(
            "model does not fit the grid: needs "
            + "; ".join(bad)
            + ": change the model sizes or the grid"
        )
