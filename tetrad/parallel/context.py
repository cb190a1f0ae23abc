"""Context parallelism: each sequence split over the ``G_context`` ranks of the context axis.

Causal attention costs more for late tokens than for early ones, so the sequence of ``S`` tokens
is cut into ``2 G_context`` chunks of ``c = S / (2 G_context)`` and context rank ``r`` holds
chunks ``r`` and ``2 G_context - 1 - r`` (the load-balanced order of Megatron-LM's context
parallelism and of Llama 3, Dubey et al., arXiv 2407.21783, section 3.3.2): every rank then
attends over ``(2 G_context + 1) c`` keys, ``2 G_context c`` of them unmasked.

Attention all-gathers keys and values over the context axis (Llama 3's choice: with grouped-query
attention K and V are ``2 kv_heads / heads`` of the query's size) and each local chunk attends over
the keys up to its end with a lower-right causal mask. Backward sums the key/value gradients with
a reduce-scatter over context.

The mask, by device (:func:`lower_right_bias`). On CUDA it is PyTorch's lower-right
:class:`torch.nn.attention.bias.CausalBias` (``causal_lower_right``): FlashAttention-2 aligns its
causal mask to the lower right when queries are fewer than keys, and the memory-efficient kernel
takes the variant as its mask type, so no mask tensor exists and the kernel skips the masked half
of the last ``c x c`` block: each rank computes the causal ideal, ``1 / G_context`` of the
sequence's causal attention. Elsewhere (the CPU kernel computes every score it is given) an
additive mask ``[c, (i+1) c]`` per chunk, built once per shape and shared by every block; there
the kernel computes ``(2 G_context + 1) / (2 G_context)`` of the ideal.

Overlap (the ``context`` overlap, :mod:`tetrad.parallel.overlap`): the all-gather is issued in
``n = n_b n_h`` pieces, over the micro-batch's samples and this rank's KV heads
(:func:`tetrad.spec.overlap.context_pieces`), all at once and asynchronously, as soon as the
keys and values exist (:meth:`ContextAttention.attend_to`: the model forms the queries, their
RoPE, after it); piece ``p``'s attention (its samples, its KV heads and the query heads that
read them) runs as soon as piece ``p`` has arrived, while pieces ``p+1 ..`` are still in
flight on the context communicator. In backward each piece's K/V gradient is reduce-scattered
asynchronously as soon as its attention backward has formed it, during the attention backward
of the remaining pieces; the waits come after the last piece and after the queries' RoPE
backward (autograd runs a block's later-created nodes first, and the pieces' launch nodes were
created before every piece's attention and before the queries). With ``n = 1`` one all-gather
runs behind the queries' RoPE alone.

Why pieces over heads and samples rather than a ring of point-to-point K/V exchanges over the
sequence (ring attention, Liu et al., arXiv 2310.01889; Megatron-LM's context parallelism): the
bytes are the same, ``(G - 1) / G`` of the gathered K/V per rank either way, and the exposed part
is one piece (one ring step) when attention is longer than the transfer, less what the queries'
RoPE hides of it (a ring hides its first step behind the local block). Every piece here is
whole attention of its heads over the whole sequence, so it is exact with the public SDPA and any
of its kernels (flash, memory-efficient, cuDNN, CPU) and needs no online-softmax merge of partial
outputs, which would need each block's log-sum-exp (private, device-specific aten ops) and a
hand-written backward. The cost: it needs ``b kv_heads / G_y >= 2`` to overlap anything (one KV
head per Y rank and one sample per micro-batch leaves one all-gather, behind the queries' RoPE
alone), and each piece's attention kernel is ``1/n`` as large.

Everything else in a block is token-wise, so only RoPE needs the chunks' global positions;
gradients are summed over data x context (:class:`tetrad.spec.grid.Axis`).

Shapes: this rank's tokens ``[b, s]`` with ``s = S / G_context``; q ``[b, heads/G_y, s, d]``,
k and v ``[b, kv_heads/G_y, s, d]``; the gathered K/V ``[b, kv_heads/G_y, S, d]``, in pieces
``[b/n_b, kv_heads/(G_y n_h), S, d]``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tetrad.comm import all_gather, reduce_scatter
from tetrad.grid import Grid
from tetrad.spec.grid import Axis
from tetrad.spec.overlap import context_pieces
from tetrad.torch_private import lower_right_causal


def chunk_ids(g: int, rank: int) -> tuple[int, int]:
    """The two sequence chunks (of ``2 g``) that context rank ``rank`` holds: ``(r, 2g-1-r)``."""
    return rank, 2 * g - 1 - rank


def split_sequence(t: torch.Tensor, grid: Grid) -> torch.Tensor:
    """This rank's tokens of ``t [b, S, ...]``: chunks ``r`` and ``2 G_context - 1 - r`` of
    ``2 G_context``, concatenated: ``[b, S/G_context, ...]``.

    Raises:
        ValueError: ``S`` not divisible by ``2 G_context``.
    """
    g = grid.context
    if g == 1:
        return t
    if t.shape[1] % (2 * g):
        raise ValueError(
            f"sequence length {t.shape[1]} is not divisible by 2*G_context = {2 * g}: "
            "choose a seq_len that is"
        )
    chunks = t.chunk(2 * g, dim=1)
    return torch.cat([chunks[i] for i in chunk_ids(g, grid.coord[Axis.CONTEXT])], dim=1)


def local_positions(s: int, grid: Grid, device: torch.device) -> torch.Tensor:
    """Global positions ``[s]`` (int64) of this rank's ``s = S / G_context`` tokens."""
    c = s // 2
    if grid.context == 1:
        return torch.arange(s, device=device)
    return torch.cat(
        [
            torch.arange(i * c, (i + 1) * c, device=device)
            for i in chunk_ids(grid.context, grid.coord[Axis.CONTEXT])
        ]
    )


def lower_right_bias(device: torch.device) -> bool:
    """Whether the chunks' masks on ``device`` are the lower-right
    :class:`~torch.nn.attention.bias.CausalBias` (CUDA: its kernels skip the masked scores)
    rather than additive mask tensors (module doc)."""
    return device.type == "cuda"


class _Pieces:
    """The in-flight collectives of one attention call's pieces: the all-gathers issued in
    forward (waited by :class:`_Arrive`) and the reduce-scatters issued in backward (waited by
    :class:`_Launch`)."""

    def __init__(self, grid: Grid, n: int):
        self.grid = grid
        self.gathers: list = [None] * n
        self.scatters: list = [None] * n


class _Launch(torch.autograd.Function):
    """Forward: issue the all-gather over context of ``t`` (one piece ``[s, ...]``) and return
    an empty token for :class:`_Arrive`. Backward: wait for the piece's gradient
    reduce-scatter that :class:`_Arrive`'s backward issued."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, state: _Pieces, p: int) -> torch.Tensor:
        ctx.state, ctx.p = state, p
        state.gathers[p] = all_gather(t, state.grid, Axis.CONTEXT, async_op=True)
        return t.new_empty(0)

    @staticmethod
    def backward(ctx, _token: torch.Tensor):
        handle, ctx.state.scatters[ctx.p] = ctx.state.scatters[ctx.p], None
        return handle.wait(), None, None


class _Arrive(torch.autograd.Function):
    """Forward: wait for piece ``p``'s all-gather, ``[G s, ...]`` in rank order. Backward: issue
    the reduce-scatter of its gradient (every rank's queries read every rank's keys) and go
    on."""

    @staticmethod
    def forward(ctx, token: torch.Tensor, state: _Pieces, p: int) -> torch.Tensor:
        ctx.state, ctx.p = state, p
        handle, state.gathers[p] = state.gathers[p], None
        return handle.wait()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        state = ctx.state
        state.scatters[ctx.p] = reduce_scatter(
            g.contiguous(), state.grid, Axis.CONTEXT, async_op=True
        )
        return g.new_zeros(0), None, None


@torch.compiler.disable
def _launch_all(kv: torch.Tensor, grid: Grid) -> tuple[_Pieces, list[torch.Tensor]]:
    """Issue the all-gather of every piece of ``kv [n_b, n_h, s, 2, b/n_b, kvh/n_h, d]``:
    ``(state, tokens)``."""
    n_b, n_h = kv.shape[:2]
    state = _Pieces(grid, n_b * n_h)
    tokens = [_Launch.apply(kv[i // n_h, i % n_h], state, i) for i in range(n_b * n_h)]
    return state, tokens


@torch.compiler.disable
def _arrive(token: torch.Tensor, state: _Pieces, p: int) -> torch.Tensor:
    return _Arrive.apply(token, state, p)


class ContextAttention:
    """Causal attention of this rank's two chunks over the whole sequence's keys and values.

    Called as ``attend_to(k, v)(q)`` (or at once, ``context_attention(q, k, v)``) with the
    module docstring's shapes; returns ``[b, heads/G_y, s, d]``. The masks (for chunk ``i``,
    over ``(i+1) c`` keys: on CUDA a lower-right :class:`~torch.nn.attention.bias.CausalBias`,
    elsewhere additive, compute dtype, ``[c, (i+1) c]``) and the chunk order are built once per
    shape and shared by every block.

    Args:
        pieces: most pieces of the K/V all-gather (:func:`tetrad.spec.overlap.context_pieces`;
            1: one blocking all-gather).
    """

    def __init__(self, grid: Grid, pieces: int = 1):
        self.grid, self.pieces = grid, pieces
        self._cache: dict[tuple, tuple[torch.Tensor, ...]] = {}

    @torch.compiler.disable  # Dynamo cannot build a CausalBias; built here, it enters as input
    def _constants(self, s: int, dtype: torch.dtype, device: torch.device):
        key = (s, dtype, device)
        if key not in self._cache:
            g, c = self.grid.context, s // 2
            order = [2 * j if j < g else 2 * (2 * g - 1 - j) + 1 for j in range(2 * g)]
            masks: list = []
            for i in chunk_ids(g, self.grid.coord[Axis.CONTEXT]):
                keys = (i + 1) * c
                if lower_right_bias(device):
                    masks.append(lower_right_causal(c, keys))
                    continue
                allowed = torch.ones(c, keys, dtype=torch.bool, device=device).tril(keys - c)
                masks.append(
                    torch.zeros(c, keys, dtype=dtype, device=device).masked_fill(
                        ~allowed, float("-inf")
                    )
                )
            index = torch.tensor(order, device=device)
            self._cache[key] = (index, *masks)
        return self._cache[key]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attend_to(k, v)(q)

    def attend_to(self, k: torch.Tensor, v: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """Issue the all-gather of ``k`` and ``v`` (every piece) and return the attention of
        queries ``q`` over them, ``q -> [b, heads/G_y, s, d]``: the keys and values travel
        while the caller forms the queries (tetrad.models.llama's ``attend_to``)."""
        b, kvh, s, d = k.shape
        n_b, n_h = context_pieces(b, kvh, self.pieces)
        kv = torch.stack((k, v)).view(2, n_b, b // n_b, n_h, kvh // n_h, s, d)
        kv = kv.permute(1, 3, 5, 0, 2, 4, 6).contiguous()  # [n_b, n_h, s, 2, bw, hw, d]
        state, tokens = _launch_all(kv, self.grid)
        return functools.partial(self._attend, state=state, tokens=tokens, shape=kv.shape)

    def _attend(self, q: torch.Tensor, state: _Pieces, tokens: list, shape) -> torch.Tensor:
        """Each piece's attention as its K/V arrive (``shape``: the packed K/V's)."""
        n_b, n_h, s, _, bw, hw, d = shape
        g, c = self.grid.context, s // 2
        qw = q.shape[1] // n_h  # query heads per piece
        index, *masks = self._constants(s, q.dtype, q.device)
        ends = [(j + 1) * c for j in chunk_ids(g, self.grid.coord[Axis.CONTEXT])]  # keys per chunk
        outs: list[list[torch.Tensor]] = [[], []]  # per local chunk, the pieces' outputs
        with _masked_kernels(q.device):
            for p, token in enumerate(tokens):
                full = _arrive(token, state, p)  # [G s, 2, bw, hw, d], rank order
                full = full.view(2 * g, c, 2, bw, hw, d).index_select(0, index).flatten(0, 1)
                keys, values = full[:, 0].permute(1, 2, 0, 3), full[:, 1].permute(1, 2, 0, 3)
                ib, ih = divmod(p, n_h)
                qp = q[ib * bw : (ib + 1) * bw, ih * qw : (ih + 1) * qw]
                for i, (half, mask, n) in enumerate(
                    zip(qp.split(c, dim=2), masks, ends, strict=True)
                ):
                    outs[i].append(
                        F.scaled_dot_product_attention(
                            half,
                            keys[:, :, :n],
                            values[:, :, :n],
                            attn_mask=mask,
                            enable_gqa=qw != hw,
                        )
                    )
        halves = [_assemble(o, n_b, n_h).transpose(1, 2) for o in outs]  # [b, c, heads, d]
        return torch.cat(halves, dim=1).transpose(1, 2)  # [b, heads, s, d], token-major


def _assemble(outs: list[torch.Tensor], n_b: int, n_h: int) -> torch.Tensor:
    """The pieces' outputs ``[b/n_b, heads/n_h, c, d]`` (sample-block-major) -> ``[b, heads, c,
    d]``; the one piece itself when ``n_b = n_h = 1`` (no copy)."""
    if n_h > 1:
        outs = [torch.cat(outs[i : i + n_h], dim=1) for i in range(0, len(outs), n_h)]
    return torch.cat(outs, dim=0) if n_b > 1 else outs[0]


def _masked_kernels(device: torch.device) -> contextlib.AbstractContextManager:
    """On CUDA the kernels the lower-right bias runs on: FlashAttention-2 (bf16, any KV heads),
    else the memory-efficient kernel with the lower-right mask type (no grouped-query heads),
    else one that takes the bias as a mask (memory-efficient, cuDNN); the training step
    otherwise allows only the flash kernels. Not yet run on a GPU. Elsewhere nothing: the CPU
    flash kernel takes the additive mask."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(
        [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    )
