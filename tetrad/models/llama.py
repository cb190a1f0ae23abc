"""Llama (Touvron et al., arXiv 2302.13971 and 2307.09288): pre-norm decoder with RMSNorm, RoPE,
SwiGLU and grouped-query attention, written once over a layer factory.

The same code builds the 3D tensor-parallel model (:class:`ParallelLayers`) and the plain
single-process reference (:class:`tetrad.models.reference.PlainLayers`). Layouts on the grid:

    residual stream       [B/(G_data G_z), S, h/G_x]        replicated over Y
    q / k / v, attention  [B/(G_data G_z), S, heads/G_y, d]  (wq, wk, wv: in X, out Y)
    attention out-proj    transposed (in Y, out X) -> back to the residual layout
    SwiGLU                w1, w3: in X, out Y; w2 transposed (in Y, out X)
    logits                [B/(G_data G_z), S, V/G_y]          (LM head: in X, out Y)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tetrad.grid import Grid
from tetrad.models.config import ModelConfig
from tetrad.parallel import Embedding, Linear, RMSNorm, vocab_parallel_cross_entropy
from tetrad.parallel.overlap import Overlap
from tetrad.spec import OVERLAPS


class ParallelLayers:
    """Builds 3D tensor-parallel layers on ``grid`` sharing one :class:`Overlap`; attention
    heads are split over Y."""

    def __init__(self, grid: Grid, overlap: Overlap):
        self.grid, self.overlap = grid, overlap
        self.head_split = grid.y

    def linear(self, k: int, n: int, *, transpose: bool = False, std: float = 0.02) -> nn.Module:
        return Linear(k, n, self.grid, transpose=transpose, init_std=std, overlap=self.overlap)

    def embedding(self, vocab: int, dim: int) -> nn.Module:
        return Embedding(vocab, dim, self.grid, overlap=self.overlap)

    def norm(self, dim: int, eps: float) -> nn.Module:
        return RMSNorm(dim, self.grid, "x", eps)

    def token_losses(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.grid, "y")


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (Su et al., arXiv 2104.09864, eq. 34), rotate-half pairing.

    ``x [B, heads, S, d]``: rotates the pair ``(x_i, x_{i+d/2})`` at position ``t`` by
    ``t * theta^(-2i/d)``.
    """
    s, d = x.shape[-2], x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(s, device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention; each Y rank owns ``heads/G_y`` query heads and the
    ``kv_heads/G_y`` key/value heads they read."""

    def __init__(self, cfg: ModelConfig, layers):
        super().__init__()
        d, hd = cfg.dim, cfg.head_dim
        self.n_heads = cfg.n_heads // layers.head_split
        self.n_kv_heads = cfg.n_kv_heads // layers.head_split
        self.head_dim, self.theta = hd, cfg.rope_theta
        self.wq = layers.linear(d, cfg.n_heads * hd)
        self.wk = layers.linear(d, cfg.n_kv_heads * hd)
        self.wv = layers.linear(d, cfg.n_kv_heads * hd)
        self.wo = layers.linear(
            cfg.n_heads * hd, d, transpose=True, std=0.02 / math.sqrt(2 * cfg.n_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope(q, self.theta), rope(k, self.theta)
        o = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_heads != self.n_kv_heads
        )
        return self.wo(o.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU (Shazeer, arXiv 2002.05202, eq. 6): ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: ModelConfig, layers):
        super().__init__()
        self.w1 = layers.linear(cfg.dim, cfg.ffn_dim)
        self.w3 = layers.linear(cfg.dim, cfg.ffn_dim)
        self.w2 = layers.linear(
            cfg.ffn_dim, cfg.dim, transpose=True, std=0.02 / math.sqrt(2 * cfg.n_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """``h = x + attention(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(self, cfg: ModelConfig, layers):
        super().__init__()
        self.attention_norm = layers.norm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, layers)
        self.ffn_norm = layers.norm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg, layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token ids ``[b, S]`` -> logits ``[b, S, V/G_y]`` (``b`` = this rank's samples)."""

    def __init__(self, cfg: ModelConfig, layers, activation_checkpointing: bool = False):
        super().__init__()
        self.cfg, self.layer_factory = cfg, layers
        self.activation_checkpointing = activation_checkpointing
        self.tok_embeddings = layers.embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, layers) for _ in range(cfg.n_layers))
        self.norm = layers.norm(cfg.dim, cfg.norm_eps)
        self.output = layers.linear(cfg.dim, cfg.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                h = checkpoint(layer, h, use_reentrant=False)
            else:
                h = layer(h)
        return self.output(self.norm(h))

    def loss_sum(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Sum of the per-token cross-entropies (nats) of this rank's ``[b, S]`` tokens."""
        return self.layer_factory.token_losses(self(tokens), targets).sum()


class Llama(Transformer):
    """The 3D tensor-parallel Llama on ``grid`` (parameters uninitialised: call
    :func:`tetrad.parallel.init_parameters`). ``overlaps``: names from
    :data:`tetrad.spec.OVERLAPS` (default: all)."""

    def __init__(
        self,
        cfg: ModelConfig,
        grid: Grid,
        activation_checkpointing: bool = False,
        overlaps=OVERLAPS,
        **overlap_options,
    ):
        self_overlap = Overlap(grid, overlaps, **overlap_options)
        super().__init__(cfg, ParallelLayers(grid, self_overlap), activation_checkpointing)
        self.overlap = self_overlap
