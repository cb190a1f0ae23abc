"""Vocabulary-parallel cross-entropy: the logits stay split, never gathered.

The vocabulary is split over one or more grid axes (the LM head's are Y and X, Y outer). With
logits ``z [T, V/G]`` on each rank (``G`` the product of the axes' sizes) and ``M = max_v z_v``
(all-reduce max over the axes), ``loss_t = log sum_v exp(z_v - M) - (z_target - M)``, both sums
all-reduced over the axes: three ``[T]`` fp32 all-reduces per axis, whatever ``V``. The gradient
on each rank is its own slice of ``softmax(z) - onehot(target)`` and needs no communication
(Shoeybi et al., Megatron-LM, arXiv 1909.08053, section 3: parallel output embedding + loss).

Two entry points:

- :func:`vocab_parallel_cross_entropy`: per-token losses from logits someone computed. Memory:
  one fp32 ``[T, V/G]`` buffer beyond the logits, ``exp(z - M)``, kept for backward (the
  division by the sum is folded into backward's scaling).
- :func:`lm_head_loss`, what training uses: the LM head and the loss fused, the sum of the
  losses of this rank's tokens. The logits are formed a block of rows at a time
  (:func:`tetrad.spec.overlap.loss_chunk_rows`), and each block's gradient ``softmax - onehot`` is
  turned into its share of ``dx = g W`` and ``dW = g^T x`` at once, in forward (``dW`` summed
  over the blocks by the GEMM's own accumulation, in the compute dtype): no ``[T, V/G]``
  tensor is kept for backward (fused linear cross-entropy; Wijmans et al., "Cut Your Losses in
  Large-Vocabulary Language Models", arXiv 2411.09009, make the same observation). The loss is
  a sum, so its gradient is one scalar ``s``: backward scales ``dx`` and ``dW`` by ``s`` and
  sends them on as the LM head's backward did (reduce-scatter over X and all-reduce over Y of
  ``dx``, reduce-scatter over Z of ``dW``). With the vocabulary split over Y or X the
  statistics ``M`` and the sum of exponentials are global only after their all-reduces, so
  each block's statistics are all-reduced as soon as its logits are formed, and its gradient
  formed from its ``exp(z - m)`` (``m`` this rank's maximum) rescaled by ``exp(m - M) /
  sum`` in the pass that divides by the sum anyway: three ``[rows]`` fp32 all-reduces per axis
  and block, no second pass over the logits, and no logits beyond one block's held (the
  micro-batch's ``[T, V/G]`` logits would be, say, 41 GiB of bf16 for llama-3.1-8b at TP 8 and
  a micro-batch of 128 x 8192 tokens). On GPUs a block holds 1 GiB of fp32 logits, so a
  micro-batch of up to ``2^28 / (V/G)`` tokens is one block and one set of all-reduces.

  When the caller knows ``s`` in forward (``grad_scale``: training divides the sum by the
  global batch's token count) and no Z reduce-scatter stands between the block and the
  gradient (``G_z = 1``), each row block's ``dW`` GEMM adds ``s g^T x`` straight into the
  weight's gradient (on CUDA one GEMM with fp32 output into the fp32 gradient where the
  device's torch runs it: :func:`tetrad.parallel.linear.gemm_adds_into`), as the block
  Linears do and as Megatron-LM's output layer adds its weight-gradient GEMM into the fp32
  main gradient (gradient-accumulation fusion). The step's first micro-batch writes a
  gradient it makes then (in its data-parallel bucket where offered:
  :meth:`tetrad.parallel.overlap.Overlap.grad_for_forward`), so every later forward adds into
  it, whatever the schedule's order: no ``dW`` is kept, scaled or added afterwards. Backward
  checks on the device that ``s`` was the gradient it got.
"""

from __future__ import annotations

import torch

from tetrad.comm import all_reduce
from tetrad.dtypes import compute_dtype
from tetrad.grid import Grid
from tetrad.parallel.head import VocabParallelHead, gather_input, scatter_input
from tetrad.parallel.linear import gemm_adds_into
from tetrad.parallel.masters import grad_dtype
from tetrad.spec.grid import Axis
from tetrad.spec.overlap import loss_chunk_rows
from tetrad.torch_private import check_on_device

HEAD_AXES = (Axis.Y, Axis.X)
"""The axes that split the LM head's vocabulary, Y outer (tetrad/parallel/head.py)."""


def _block(grid: Grid, axes: tuple[Axis, ...]) -> int:
    """This rank's vocabulary block index over ``axes`` (the first outer)."""
    block = 0
    for a in axes:
        block = block * grid.size(a) + grid.coord[a]
    return block


def _local_targets(targets: torch.Tensor, first: int, rows: int):
    """``(local ids, outside)``: targets relative to this rank's vocabulary block ``[first,
    first + rows)`` (0 where outside) and the mask of those outside it."""
    local = targets - first
    outside = (local < 0) | (local >= rows)
    return local.masked_fill(outside, 0), outside


def _padding_start(vocab: int | None, first: int, rows: int) -> int | None:
    """The first local column that is vocabulary padding (ids ``>= vocab``), or None."""
    if vocab is None or vocab >= first + rows:
        return None
    return max(0, vocab - first)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, grid: Grid, axes: tuple[Axis, ...], vocab: int | None):
        vocab_local = logits.shape[-1]
        first = _block(grid, axes) * vocab_local
        m = _all_reduce_over(logits.amax(dim=-1).float(), grid, axes, op="max")
        local, outside = _local_targets(targets, first, vocab_local)
        z_target = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).float() - m
        z_target = _all_reduce_over(z_target.masked_fill(outside, 0.0), grid, axes)
        # one fp32 [..., V/G] buffer, exp(z - M) in place; saved, and turned into the gradient
        # in place by backward
        exp = torch.empty_like(logits, dtype=torch.float32)
        torch.sub(logits, m.unsqueeze(-1), out=exp).exp_()
        pad = _padding_start(vocab, first, vocab_local)
        if pad is not None:  # padding ids: no mass
            exp[..., pad:] = 0.0
        sum_exp = _all_reduce_over(exp.sum(dim=-1), grid, axes)
        ctx.save_for_backward(exp, sum_exp, local, outside)
        ctx.dtype = logits.dtype
        return sum_exp.log() - z_target

    @staticmethod
    def backward(ctx, dloss):
        # d loss_t / d z_v = softmax_v - [v = target]: one pass scales exp(z - M) by
        # dloss / sum_exp (the softmax's division folded in), then the target entries
        exp, sum_exp, local, outside = ctx.saved_tensors
        grad = exp.mul_((dloss / sum_exp).unsqueeze(-1))
        hit = dloss.masked_fill(outside, 0.0)
        grad.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None


def _all_reduce_over(t: torch.Tensor, grid: Grid, axes, op: str = "sum") -> torch.Tensor:
    for a in axes:
        t = all_reduce(t, grid, a, op=op)
    return t


def _global_statistics(
    row_max: torch.Tensor, sum_exp: torch.Tensor, z_target: torch.Tensor, grid: Grid
) -> torch.Tensor:
    """This rank's per-row statistics of its vocabulary block (``[rows]`` fp32 each: the
    largest logit ``m``, the sum of ``exp(z - m)``, the target's logit or 0) made those of the
    whole vocabulary over the LM head's axes, in place: ``M`` (all-reduce max), the sums
    rescaled to ``M`` and all-reduced, the target logits all-reduced (module docstring).
    Returns the rescaling ``exp(m - M)``, ``[rows]`` fp32 (a new tensor)."""
    shift = row_max.clone()
    _all_reduce_over(row_max, grid, HEAD_AXES, op="max")
    shift.sub_(row_max).exp_()
    sum_exp.mul_(shift)
    _all_reduce_over(sum_exp, grid, HEAD_AXES)
    _all_reduce_over(z_target, grid, HEAD_AXES)
    return shift


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    grid: Grid,
    axes: Axis | tuple[Axis, ...] = HEAD_AXES,
    vocab: int | None = None,
) -> torch.Tensor:
    """Per-token cross-entropy (nats) from vocabulary-sharded logits.

    Args:
        logits: ``[..., V/G]``, this rank's contiguous vocabulary block, block index
            ``sum_i coord(axes[i]) * prod_{j>i} G_{axes[j]}`` (the first axis outer), ``G``
            the product of the axes' sizes (any float dtype; computed in fp32).
        targets: ``[...]`` global token ids.
        axes: the axes splitting the vocabulary, outer first (one axis alone is allowed).
        vocab: the real vocabulary when the logits' is padded: ids ``>= vocab`` get no
            probability (their ``exp`` is zeroed, so their gradient is 0 too).
    Returns:
        ``[...]`` fp32 losses, identical on every rank of ``axes``.
    """
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    return _VocabParallelCrossEntropy.apply(logits, targets, grid, axes, vocab)


# ---- the LM head and the loss, fused -----------------------------------------------------------


class _Blocks:
    """One micro-batch's logits, a block of rows at a time: ``x [m, h]``, ``w [V/G, h]`` (both
    in the compute dtype), local targets; reusable buffers for one block's logits and their fp32
    softmax."""

    def __init__(self, x, w, local, outside, pad: int | None, rows: int):
        self.x, self.w, self.local, self.pad = x, w, local, pad
        self.hit = (~outside).to(torch.float32).neg_().unsqueeze(-1)  # -1 at the target
        n = min(rows, x.shape[0])
        self.rows = rows
        self.z = torch.empty(n, w.shape[0], dtype=x.dtype, device=x.device)
        fp32 = x.dtype == torch.float32
        self.p = self.z if fp32 else torch.empty_like(self.z, dtype=torch.float32)

    def spans(self):
        m = self.x.shape[0]
        return ((s, min(m, s + self.rows)) for s in range(0, m, self.rows))

    def logits(self, s: int, e: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x[s:e] W^T`` (into ``out``, else this block's buffer)."""
        out = self.z[: e - s] if out is None else out
        return torch.mm(self.x[s:e], self.w.t(), out=out)

    def exp(self, z: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """``exp(z - m)`` fp32 in the softmax buffer (padding columns 0)."""
        p = torch.sub(z, m.unsqueeze(-1), out=self.p[: z.shape[0]]).exp_()
        if self.pad is not None:
            p[:, self.pad :] = 0.0
        return p

    def gradient(
        self,
        s: int,
        e: int,
        p: torch.Tensor,
        per_row: torch.Tensor,
        dx,
        dw,
        scale=None,
        fresh=False,
    ) -> None:
        """``g = p per_row - onehot`` for rows ``s:e`` (``per_row [e - s]``: the softmax's
        ``1 / sum_exp``, times ``exp(m - M)`` where ``p = exp(z - m)`` was taken at this
        rank's maximum ``m`` and ``M`` is the global one); ``dx[s:e] = g W``, ``dw += g^T x``
        (``scale``: ``dw`` is the gradient, ``dw += scale g^T x``, written rather than added
        on the first block where ``fresh``)."""
        p.mul_(per_row.unsqueeze(-1))
        p.scatter_add_(-1, self.local[s:e].unsqueeze(-1), self.hit[s:e])
        g = p if p.dtype == self.x.dtype else p.to(self.x.dtype)
        torch.mm(g, self.w, out=dx[s:e])
        if scale is not None:
            add_product(dw, g.t(), self.x[s:e], scale, 0.0 if fresh and s == 0 else 1.0)
        elif s == 0:
            torch.mm(g.t(), self.x[s:e], out=dw)
        else:  # the GEMM adds the blocks so far in its fp32 accumulation
            dw.addmm_(g.t(), self.x[s:e])


def add_product(
    out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float, beta: float = 1.0
) -> None:
    """``out = beta out + alpha a b`` in place (``beta`` 1 or 0; 0: ``out``'s contents are not
    read): ``out [n, k]`` (the gradient), ``a [n, m]`` and ``b [m, k]`` in the compute dtype:
    the GEMM accumulating into ``out`` where it can
    (:func:`tetrad.parallel.linear.gemm_adds_into`), else the product in the compute dtype,
    then added (or written)."""
    if gemm_adds_into(out, a, b, alpha, beta):
        return
    if beta:
        out.add_(torch.mm(a, b), alpha=alpha)
    else:
        torch.mul(torch.mm(a, b), alpha, out=out)


class _LMHeadLoss(torch.autograd.Function):
    """``sum_t CE(all-gather_X(x_t) all-gather_Z(W_shard)^T, target_t)``; module docstring."""

    @staticmethod
    def forward(
        ctx,
        x,
        w_shard,
        targets,
        ov,
        vocab: int | None,
        rows: int,
        need_grad: bool,
        seq: bool,
        grad_scale: float | None,
    ):
        grid, dtype = ov.grid, compute_dtype(x)
        # the backward's scale known (G_z = 1): dW goes into the gradient here
        target = ov.grad_for_forward(w_shard) if need_grad and grad_scale is not None else None
        into, fresh = target if target is not None else (None, False)
        scale = grad_scale if into is not None else None
        w = ov.gather_weight(w_shard, dtype)  # [V/(G_y G_x), h]
        x_full = gather_input(x.to(dtype), grid, seq)  # [..., h], the whole sequence
        xm = x_full.reshape(-1, x_full.shape[-1])
        v_local, split = w.shape[0], grid.y * grid.x > 1
        first = _block(grid, HEAD_AXES) * v_local
        local, outside = _local_targets(targets.reshape(-1), first, v_local)
        m_rows = xm.shape[0]
        stats = torch.empty(3, m_rows, dtype=torch.float32, device=x.device)
        row_max, sum_exp, z_target = stats  # this rank's, until the all-reduces
        if need_grad:
            dx = torch.empty_like(xm)
            dw = into
            if into is None:
                dw = torch.empty(v_local, xm.shape[1], dtype=dtype, device=x.device)
        with torch.autocast(x.device.type, enabled=False):  # operands are in compute dtype
            blocks = _Blocks(xm, w, local, outside, _padding_start(vocab, first, v_local), rows)
            for s, e in blocks.spans():
                z = blocks.logits(s, e)
                row_max[s:e] = z.amax(dim=-1)
                z_target[s:e] = z.gather(-1, local[s:e].unsqueeze(-1)).squeeze(-1)
                z_target[s:e].masked_fill_(outside[s:e], 0.0)
                p = blocks.exp(z, row_max[s:e])
                sum_exp[s:e] = p.sum(dim=-1)
                if split:  # the block's statistics made global; p rescaled to them
                    shift = _global_statistics(row_max[s:e], sum_exp[s:e], z_target[s:e], grid)
                    per_row = shift.div_(sum_exp[s:e])
                else:
                    per_row = sum_exp[s:e].reciprocal()
                if need_grad:
                    blocks.gradient(s, e, p, per_row, dx, dw, scale, fresh)
        if need_grad:
            ctx.save_for_backward(dx, *(() if into is not None else (dw,)))
            ctx.weight, ctx.ov, ctx.shape, ctx.seq = w_shard, ov, x_full.shape, seq
            ctx.added = scale
        return (sum_exp.log() + row_max - z_target).sum()

    @staticmethod
    def backward(ctx, dloss):
        dx, *kept = ctx.saved_tensors
        ov, none = ctx.ov, (None,) * 8
        handle = scatter_input((dx * dloss.to(dx.dtype)).view(ctx.shape), ov, ctx.seq)
        if ctx.added is not None:  # forward added dW, scaled by the promised gradient
            check_on_device(
                (dloss - ctx.added).abs() <= 1e-6 * abs(ctx.added),
                "lm_head_loss: backward's gradient differs from grad_scale",
            )
            ov.weight_grad_added(ctx.weight)
            return handle.wait(), *none
        (dw,) = kept
        have = ov.grad_to_add_into(ctx.weight)  # a later micro-batch: scaled and added at once
        if have is not None:
            have.addcmul_(dw, dloss.to(have.dtype))
            ov.weight_grad_added(ctx.weight)
            return handle.wait(), *none
        slot = ov.grad_slot(ctx.weight)  # its place in the data-parallel bucket, if offered
        if slot is not None:
            dw = torch.mul(dw, dloss, out=slot)
        elif dw.dtype == grad_dtype(ctx.weight):
            dw.mul_(dloss)
        else:  # scaled into the fp32 reduce-scatter input in one pass
            dw = torch.mul(dw, dloss, out=torch.empty_like(dw, dtype=grad_dtype(ctx.weight)))
        ov.reduce_weight_grad(ctx.weight, dw)
        return handle.wait(), *none


@torch.compiler.disable  # collectives and the overlap state stay outside compiled graphs
def lm_head_loss(
    head: VocabParallelHead,
    x: torch.Tensor,
    targets: torch.Tensor,
    vocab: int | None = None,
    grad_scale: float | None = None,
) -> torch.Tensor:
    """Sum over this rank's tokens of the cross-entropy (nats) of ``head(x)`` against
    ``targets``, without forming the logits of all tokens at once (module docstring).

    Args:
        head: the LM head (its weight, grid and overlap).
        x: hidden states ``[b, s, dim/G_x]``, replicated over Y (with the head's
            ``sequence_parallel``: ``[b, s/G_y, dim/G_x]``, this Y rank's piece of the
            sequence).
        targets: ``[b, s]`` global token ids.
        vocab: the real vocabulary when the head's is padded (ids ``>= vocab`` get no
            probability).
        grad_scale: the gradient backward will bring to the returned sum (training's
            ``1 / tokens``), when the caller knows it: with ``G_z = 1`` the head's ``dW`` then
            goes into its gradient in forward (module docstring).
    Returns:
        0-dim fp32 tensor, identical on every rank of Y and X. Its gradient fills
        ``head.weight.grad`` through the overlap and flows to ``x`` as the head's would.
    Raises:
        RuntimeError: backward brought another gradient than ``grad_scale`` after forward had
            added ``dW`` (on CUDA a device-side assertion: :func:`tetrad.torch_private.
            check_on_device`).
    """
    grid = head.grid
    v_local = head.vocab // (grid.y * grid.x)
    rows = loss_chunk_rows(v_local, targets.numel(), x.device.type)
    need_grad = torch.is_grad_enabled() and (x.requires_grad or head.weight.requires_grad)
    seq = head.sequence_parallel
    return _LMHeadLoss.apply(
        x, head.weight, targets, head.overlap, vocab, rows, need_grad, seq, grad_scale
    )
