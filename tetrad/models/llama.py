"""Llama (Touvron et al., arXiv 2302.13971 and 2307.09288): pre-norm decoder with RMSNorm, RoPE,
SwiGLU and grouped-query attention.

The architecture alone: every layer comes from a :class:`Layers` factory, so the same code is the
plain single-process reference (:class:`tetrad.models.reference.PlainLayers`) and the 3D
tensor-parallel model (:class:`tetrad.parallel.model.ParallelLayers`, whose docstring gives the
layouts on the grid). Nothing here knows the grid.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tetrad.dtypes import recompute_context, residual_dtype
from tetrad.models import recompute
from tetrad.models.moe import MoEFeedForward
from tetrad.models.swiglu import swiglu
from tetrad.spec.activation_checkpointing import checkpointed_blocks, parse_checkpointing
from tetrad.spec.model import ModelSpec


class Layers(Protocol):
    """What the model needs of a layer factory.

    ``head_split`` attention heads are split over that many ranks (1 in the reference);
    ``positions(s, device)`` gives the sequence positions ``[s]`` (int64) of this rank's ``s``
    tokens of each sample (``0 .. s-1`` unless the sequence is split over ranks);
    ``attend_to(k, v)`` takes keys and values ``[b, kv_heads, s, d]`` and returns causal
    attention of this rank's queries ``[b, heads, s, d]`` over them, ``q -> [b, heads, s, d]``
    (grouped-query when the head counts differ): the keys and values come first, so that an
    implementation can move them while the queries are formed;
    ``linear(k, n)`` maps ``[..., k] -> [..., n]`` (``transpose`` marks the second layer of a
    pair: the attention out-projection and the SwiGLU down-projection; ``stacked=s``: its weight
    stacks ``s`` matrices of ``n/s`` rows, SwiGLU's gate and up, and its output features come in
    ``stacked_pieces`` pieces of ``s`` contiguous blocks each, 1 piece in the reference:
    :func:`tetrad.models.swiglu.swiglu`); ``head(dim, V)`` is the
    LM head ``[..., dim] -> [..., V]``; ``loss_sum(head, x, targets, vocab, grad_scale)`` gives
    the sum over tokens of the cross-entropy (nats) of ``head(x)`` against ``targets [...]``,
    over the first ``vocab`` ids only when given (the rest is padding); it may never form all
    the logits, and where the caller gives ``grad_scale``, the gradient backward will bring to
    the sum, it may form the head's weight gradient in forward.

    Mixture of experts (:mod:`tetrad.models.moe`): ``router(dim, E)`` maps ``[T, dim]`` to
    router logits ``[T, E]``; ``experts(E, dim, F, out_std)`` is the routed experts,
    ``(x [T, dim], ids [T, k], weights [T, k]) -> [T, dim]`` (dispatch, expert GEMMs and
    combine: the module an expert-parallel runtime provides). ``head_norm(d, eps)`` is the
    per-head RMSNorm of queries and keys (``qk_norm``): a module whose ``weight [d]`` is used.
    Optional attributes: ``sequence_sum``, ``sequence_parts`` and ``moe_tokens``
    (:class:`tetrad.models.moe.MoEFeedForward`); ``sequence_split``: the residual stream
    between the layers holds ``s / sequence_split`` of each sample's ``s`` tokens (1 if absent).
    """

    head_split: int
    stacked_pieces: int

    def linear(
        self, k: int, n: int, *, transpose: bool = False, std: float = 0.02, stacked: int = 1
    ) -> nn.Module: ...

    def embedding(self, vocab: int, dim: int) -> nn.Module: ...

    def positions(self, s: int, device: torch.device) -> torch.Tensor: ...

    def attend_to(
        self, k: torch.Tensor, v: torch.Tensor
    ) -> Callable[[torch.Tensor], torch.Tensor]: ...

    def head(self, dim: int, vocab: int) -> nn.Module: ...

    def norm(self, dim: int, eps: float) -> nn.Module: ...

    def loss_sum(
        self,
        head: nn.Module,
        x: torch.Tensor,
        targets: torch.Tensor,
        vocab: int | None = None,
        grad_scale: float | None = None,
    ) -> torch.Tensor: ...

    def router(self, dim: int, n_experts: int) -> nn.Module: ...

    def head_norm(self, dim: int, eps: float) -> nn.Module: ...

    def experts(self, n_experts: int, dim: int, ffn_dim: int, out_std: float) -> nn.Module: ...


def rope_frequencies(d: int, cfg: ModelSpec, device: torch.device) -> torch.Tensor:
    """The ``d/2`` rotation frequencies ``theta^(-2i/d)`` (fp32), rescaled as Llama 3.1 does
    when ``cfg.rope_factor != 1``: wavelengths above ``original / low_freq_factor`` are slowed
    by ``factor``, those below ``original / high_freq_factor`` kept, and those between
    interpolated (Llama 3.1 reference code, ``apply_scaling``; HF ``rope_type="llama3"``)."""
    inv_freq = cfg.rope_theta ** (-torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    if cfg.rope_factor == 1.0:
        return inv_freq
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    original = cfg.rope_original_positions
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    between = (wavelen <= original / low) & (wavelen >= original / high)
    return torch.where(between, (1 - smooth) * slowed / factor + smooth * slowed, slowed)


def rope(x: torch.Tensor, inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al., arXiv 2104.09864, eq. 34), rotate-half pairing.

    ``x [B, heads, s, d]``: rotates the pair ``(x_i, x_{i+d/2})`` of the token at position
    ``positions[t]`` (``[s]``) by ``positions[t] * inv_freq[i]`` (:func:`rope_frequencies`).
    """
    angles = torch.outer(positions.to(torch.float32), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention over this rank's ``heads / head_split`` query heads
    and the ``kv_heads / head_split`` key/value heads they read.

    One projection ``wqkv`` gives q, k and v. Its output features are grouped by KV head: for
    KV head ``j``, its ``g = heads / kv_heads`` query heads ``j g ... j g + g - 1``, then
    ``k_j``, then ``v_j``, ``head_dim`` features each (``[kv_heads, g + 2, head_dim]``). Any
    split of the features into equal contiguous blocks over whole groups (the parallel layers'
    Y split) gives each rank its query heads with the KV heads they read.
    """

    def __init__(self, cfg: ModelSpec, layers: Layers):
        super().__init__()
        d, hd = cfg.dim, cfg.head_dim
        self.group = cfg.n_heads // cfg.n_kv_heads
        self.n_kv_heads = cfg.n_kv_heads // layers.head_split
        self.n_heads = self.n_kv_heads * self.group
        self.head_dim, self.cfg = hd, cfg
        self.attend_to = layers.attend_to
        self.wqkv = layers.linear(d, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd)
        self.wo = layers.linear(
            cfg.n_heads * hd, d, transpose=True, std=0.02 / math.sqrt(2 * cfg.n_layers)
        )
        if cfg.qk_norm:  # Qwen3: RMSNorm of each q and k head before RoPE
            self.q_norm = layers.head_norm(hd, cfg.norm_eps)
            self.k_norm = layers.head_norm(hd, cfg.norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        qkv = self.wqkv(x)
        inv_freq = rope_frequencies(self.head_dim, self.cfg, x.device)
        qn, kn = ((self.q_norm.weight,), (self.k_norm.weight,)) if self.cfg.qk_norm else ((), ())
        # One split (its backward concatenates the three gradients into one tensor); RoPE and
        # the head split are recomputed from the kept wqkv output (these views) in selective mode.
        q, k, v = self._split(qkv).split((self.group, 1, 1), dim=-2)
        k = recompute.runner()(self._rotated_keys, k, inv_freq, positions, *kn)
        v = recompute.runner()(self._values, v)
        attend = self.attend_to(k, v)  # keys and values first: they may travel while q rotates
        q = recompute.runner()(self._rotated_queries, q, inv_freq, positions, *qn)
        return self.wo(recompute.runner()(self._merge_heads, attend(q)))

    def _split(self, qkv: torch.Tensor) -> torch.Tensor:
        """``[b, s, (heads + 2 kv_heads) d]`` -> ``[b, s, kv_heads, group + 2, d]`` (a view)."""
        return qkv.unflatten(-1, (self.n_kv_heads, self.group + 2, self.head_dim))

    def _rotated_queries(self, q, inv_freq, positions, *norm) -> torch.Tensor:
        """Rotated q ``[b, heads, s, d]`` from its piece ``q [b, s, kv_heads, group, d]`` of the
        wqkv output (each head RMS-normalised with weight ``norm[0]`` first when given)."""
        b, s = q.shape[:2]
        q = q.reshape(b, s, self.n_heads, self.head_dim)
        q = head_rms_norm(q, norm[0], self.cfg.norm_eps) if norm else q
        return rope(q.transpose(1, 2), inv_freq, positions)

    def _rotated_keys(self, k, inv_freq, positions, *norm) -> torch.Tensor:
        """Rotated k ``[b, kv_heads, s, d]`` from its piece ``k [b, s, kv_heads, 1, d]``
        (normalised first with ``norm[0]``, as q)."""
        k = k.squeeze(-2)
        k = head_rms_norm(k, norm[0], self.cfg.norm_eps) if norm else k
        return rope(k.transpose(1, 2), inv_freq, positions)

    def _values(self, v: torch.Tensor) -> torch.Tensor:
        """v ``[b, kv_heads, s, d]`` from its piece ``[b, s, kv_heads, 1, d]``, a copy: SDPA
        keeps v, not all of qkv."""
        return v.squeeze(-2).contiguous().transpose(1, 2)

    @staticmethod
    def _merge_heads(o: torch.Tensor) -> torch.Tensor:
        """``[b, heads, s, d]`` -> ``[b, s, heads d]`` (a copy when ``o`` is heads-major)."""
        return o.transpose(1, 2).flatten(2)


def head_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x [..., d]`` with weight ``w [d]`` (Zhang and Sennrich,
    arXiv 1910.07467, eq. 4): normalised in fp32, rounded to ``x``'s dtype, then scaled (the
    order of transformers' Qwen3 ``q_norm`` / ``k_norm``)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w


class FeedForward(nn.Module):
    """SwiGLU (Shazeer, arXiv 2002.05202, eq. 6): ``w2(silu(x W1^T) * x W3^T)``.

    The gate ``W1`` and up ``W3`` projections are one Linear ``w13`` whose weight stacks them,
    ``[2, f, dim]`` (``[W1; W3]``, stored ``[2f, dim]``): its output is ``[gate, up]``, or on a
    split weight ``layers.stacked_pieces`` such pairs of blocks.
    """

    def __init__(self, cfg: ModelSpec, layers: Layers, ffn_dim: int | None = None):
        super().__init__()
        ffn_dim = ffn_dim or cfg.ffn_dim  # another width: an MoE block's shared expert
        self.w13 = layers.linear(cfg.dim, 2 * ffn_dim, stacked=2)
        self.act = functools.partial(swiglu, pieces=layers.stacked_pieces)
        self.w2 = layers.linear(
            ffn_dim, cfg.dim, transpose=True, std=0.02 / math.sqrt(2 * cfg.n_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # selective mode keeps the w13 output and recomputes the product in backward (runner()
        # after w13's graph break: see recompute.runner)
        gate_up = self.w13(x)
        return self.w2(recompute.runner()(self.act, gate_up))


class Block(nn.Module):
    """``h = x + attention(norm(x)); out = h + ffn(norm(h))``; ``ffn`` the SwiGLU, or the
    mixture of experts (:class:`tetrad.models.moe.MoEFeedForward`) when ``moe``."""

    def __init__(self, cfg: ModelSpec, layers: Layers, moe: bool = False):
        super().__init__()
        self.attention_norm = layers.norm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, layers)
        self.ffn_norm = layers.norm(cfg.dim, cfg.norm_eps)
        if moe:
            shared = FeedForward(cfg, layers, cfg.shared_ffn_dim) if cfg.shared_ffn_dim else None
            self.feed_forward = MoEFeedForward(cfg, layers, shared)
        else:
            self.feed_forward = FeedForward(cfg, layers)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), positions)
        return h + self.feed_forward(self.ffn_norm(h))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal grouped-query attention, ``q [b, heads, s, d]``, ``k, v [b, kv_heads, s, d]`` ->
    ``[b, heads, s, d]`` (SDPA: FlashAttention where the device has it)."""
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
    )


def attend_causally_to(k: torch.Tensor, v: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`causal_attention` over ``k`` and ``v``, as a function of the queries (the layers'
    ``attend_to``)."""
    return functools.partial(causal_attention, k=k, v=v)


@dataclass(frozen=True)
class ModelPart:
    """A contiguous slice of the model, as a pipeline stage holds it: blocks ``[start, stop)``,
    with the token embedding when ``first`` and the final norm and LM head when ``last``
    (torchtitan's model parts; parameter names stay those of the whole model)."""

    start: int
    stop: int
    first: bool = True
    last: bool = True

    @classmethod
    def whole(cls, n_layers: int) -> ModelPart:
        return cls(0, n_layers)


class Transformer(nn.Module):
    """Token ids ``[b, s]`` -> logits ``[b, s, V]`` (``b``, ``s`` = this rank's samples and
    tokens of each; the parallel factory's LM head gives this rank's vocabulary slice
    ``V/(G_y G_x)``).

    ``activation_checkpointing``: a mode of
    :data:`tetrad.spec.activation_checkpointing.CHECKPOINTING`, or ``selective:K`` (the last ``K``
    blocks selective, the others ``none``), or a bool (``True`` = ``full``). ``part``: the
    slice of the model to build (default: all of it); a part without the embedding takes the
    residual stream ``[b, s, dim]`` instead of token ids, one without the head has ``norm`` and
    ``output`` None.

    Raises:
        tetrad.spec.activation_checkpointing.CheckpointingError: an unknown mode, or ``K`` above
            ``cfg.n_layers``.
    """

    def __init__(
        self,
        cfg: ModelSpec,
        layers: Layers,
        activation_checkpointing: str | bool = "none",
        part: ModelPart | None = None,
    ):
        super().__init__()
        self.cfg, self.layer_factory = cfg, layers
        self.part = part = part or ModelPart.whole(cfg.n_layers)
        self.activation_checkpointing = parse_checkpointing(activation_checkpointing)
        mode, k = checkpointed_blocks(self.activation_checkpointing, cfg.n_layers)
        modes = ("none",) * (cfg.n_layers - k) + (mode,) * k
        self.block_modes = modes[part.start : part.stop]
        self.tok_embeddings = layers.embedding(cfg.vocab_size, cfg.dim) if part.first else None
        ids = range(part.start, part.stop)
        self.layers = nn.ModuleDict({str(i): Block(cfg, layers, cfg.moe_block(i)) for i in ids})
        self.norm = layers.norm(cfg.dim, cfg.norm_eps) if part.last else None
        self.output = layers.head(cfg.dim, cfg.vocab_size) if part.last else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output(self.hidden(tokens))

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final norm's output ``[b, s, dim]``: what the LM head reads (a part without the
        head: its last block's output; without the embedding, ``tokens`` is the residual
        stream ``[b, s, dim]``)."""
        s = tokens.shape[1]
        if self.tok_embeddings is not None:  # the residual stream's format (the policy's)
            h = self.tok_embeddings(tokens)
            h = h.to(residual_dtype(h.device, self.tok_embeddings.weight.dtype))
        else:  # the residual stream may hold a part of each sample's tokens
            h, s = tokens, s * getattr(self.layer_factory, "sequence_split", 1)
        positions = self.layer_factory.positions(s, tokens.device)
        grad = torch.is_grad_enabled()
        for layer, mode in zip(self.layers.values(), self.block_modes, strict=True):
            if not grad or mode == "none":
                h = layer(h, positions)
            elif mode == "full":
                h = checkpoint(
                    layer, h, positions, use_reentrant=False, context_fn=recompute_context
                )
            else:  # selective (tetrad.models.recompute): no GEMM or collective re-runs
                with recompute.selective():
                    h = layer(h, positions)
        return self.norm(h) if self.norm is not None else h

    def aux_loss_sum(self) -> torch.Tensor | None:
        """The load-balancing loss of the last forward, summed over its MoE blocks (each
        ``aux_loss_coef`` x :func:`tetrad.models.moe.load_balance_loss`: a sum over this rank's
        sequences, to divide by the global number of sequences); None for a dense model, a
        coefficient of 0 or a forward without grad."""
        parts = [
            b.feed_forward.aux_loss
            for b in self.layers.values()
            if getattr(b.feed_forward, "aux_loss", None) is not None
        ]
        return torch.stack(parts).sum() if parts else None

    def moe_blocks(self) -> dict[int, MoEFeedForward]:
        """This part's MoE feed-forwards by block index (0-based, over the whole model)."""
        return {
            int(i): b.feed_forward
            for i, b in self.layers.items()
            if isinstance(b.feed_forward, MoEFeedForward)
        }

    def record_routing(self) -> None:
        """Add the last forward's routing statistics of each MoE block
        (:attr:`tetrad.models.moe.MoEFeedForward.routing`, ``[E + 1]``) to the block's sum since
        :meth:`take_routing`, on the device (no host read). Call once per training forward,
        after it and before its backward: a recomputed forward (activation checkpointing) only
        rewrites the same statistics. Nothing for a forward without grad."""
        for ff in self.moe_blocks().values():
            if ff.routing is not None:
                got = ff.routing_sum
                ff.routing_sum = ff.routing if got is None else got + ff.routing
                ff.routing = None

    def take_routing(self) -> dict[int, torch.Tensor]:
        """The routing statistics recorded since the last call, ``[E + 1]`` per MoE block index
        (blocks with none left out), and forget them."""
        out = {}
        for i, ff in self.moe_blocks().items():
            if ff.routing_sum is not None:
                out[i], ff.routing_sum = ff.routing_sum, None
        return out

    def loss_sum(
        self, tokens: torch.Tensor, targets: torch.Tensor, grad_scale: float | None = None
    ) -> torch.Tensor:
        """Sum of the per-token cross-entropies (nats) of this rank's ``[b, s]`` tokens
        (``grad_scale``: the gradient backward will bring to it, when known: the layer
        factory's ``loss_sum``)."""
        vocab = self.cfg.unpadded_vocab or None
        x = self.hidden(tokens)
        return self.layer_factory.loss_sum(self.output, x, targets, vocab, grad_scale)
