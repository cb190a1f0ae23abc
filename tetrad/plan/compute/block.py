"""FLOPs and compute time of one rank of the 4D grid, per micro-batch.

Per rank and micro-batch, ``m = micro_batch * seq_len`` tokens (the micro-batch of one (data, z)
cell: X and Y ranks of a cell see the same tokens). A Linear ``[n, k]`` computes, whatever its
orientation (tetrad/parallel/linear.py):

    forward  y  = x W_blk^T       2 m n k / (G_x G_y) FLOPs
    backward dx = dy W_blk        2 m n k / (G_x G_y)
             dW = dy^T x          2 m n k / (G_x G_y)

Causal self-attention per rank (heads split over Y, ``a/G_y`` heads of width ``d``): ``Q K^T``
and ``P V`` cost ``2 S^2 d`` each per head and sample; the causal mask halves them (PaLM,
Chowdhery et al. arXiv 2204.02311, appendix B, counts the same half), so the forward is
``2 b S^2 d a / G_y``. FlashAttention's backward runs five matmuls against the forward's two
(Dao, arXiv 2307.08691, section 3.1.2: it recomputes ``Q K^T``): 2.5x the forward.

Time of a GEMM = FLOPs / (peak * efficiency(FLOPs)), the efficiency from the machine's GEMM table
(:meth:`tetrad.plan.machine.description.Machine.gemm_efficiency`); attention at the machine's
``attention_efficiency``. Element-wise work (norms, residual adds, RoPE, SwiGLU/GeLU, the
vocabulary-parallel softmax, the embedding lookup, AdamW) is memory bound: bytes moved / HBM
bandwidth, with byte counts per token estimated from the runtime's unfused PyTorch ops (rough:
see :data:`ELEMENTWISE`). Under sequence parallelism (``sequence_split = G_y``,
tetrad/parallel/sequence.py; Korthikanti et al., arXiv 2205.05198, section 4.2.2) the norms
and residual adds run on the ``[b, S/(G_context G_y), h/G_x]`` stream: ``m / G_y`` tokens.

Activation checkpointing (:data:`tetrad.spec.activation_checkpointing.CHECKPOINTING`): ``full``
re-runs each block's forward in backward (GEMMs, attention, element-wise, and its collectives:
tetrad/plan/comm/linears.py);
``selective`` (tetrad/models/recompute.py; Korthikanti et al., arXiv 2205.05198, section 5)
re-runs only the element-wise parts whose outputs it does not keep (the two RMSNorm applies, RoPE,
SwiGLU), once each: the rebuild for the consumer records the graph its own backward uses.

Model FLOPs (for MFU) are the runtime's definition, :meth:`ModelSpec.flops_per_token` (``6 N +
6 L S h``), so recomputation and FlashAttention's extra backward matmul do not count.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tetrad.plan.comm.context_parallel import local_seq_len
from tetrad.plan.compute.elementwise import ELEMENTWISE
from tetrad.plan.compute.flops import attention_fwd_flops
from tetrad.plan.compute.fp8 import converts, fp8_gemm
from tetrad.plan.machine.description import Machine
from tetrad.spec.activation_checkpointing import checkpointed_blocks
from tetrad.spec.grid import with_context
from tetrad.spec.model import ModelSpec
from tetrad.spec.overlap import loss_blocks

ATTENTION_BWD = 2.5
"""Attention backward seconds over forward: FlashAttention's five matmuls against two (module
doc)."""


@dataclass(frozen=True)
class BlockCompute:
    """Compute seconds of one rank for one micro-batch.

    Attributes:
        gemm: per block Linear (execution order), one GEMM's seconds (forward = dx = dW).
        gemm_flops: per block Linear, one GEMM's FLOPs.
        post_fwd: per block Linear, the non-GEMM forward work that follows it before the next
            Linear (attention core after the last Linear before the first transposed one, the
            activation before the second transposed one, norm + residual after transposed ones).
        post_bwd: the backward of ``post_fwd``.
        head: the LM head's GEMM seconds (one of logits, dx, dW: the three run in forward,
            fused with the loss).
        head_flops: its FLOPs.
        loss_fwd: the fused loss's element-wise forward (softmax, gradient), seconds.
        loss_bwd: its backward: ``dx`` scaled by the loss's gradient, seconds.
        head_dw_blocks: the row blocks' ``dW`` sum in the compute dtype, forward seconds, where
            a micro-batch forms its ``dW`` apart (``G_z > 1``, :meth:`over_step`).
        head_dw_scale: the scaling of that ``dW`` into its fp32 copy in backward, seconds
            (the head's Y all-reduce runs during it; :meth:`over_step` with ``G_z = 1``: 0).
        embedding_fwd, embedding_bwd: lookup, and the scatter-add of the micro-batch's rows
            into the ``[V/G_y, h/G_x]`` gradient table.
        embedding_zero: the zeroing of that table (4 bytes per element), on the first
            micro-batch of a step, or on each with ``G_z > 1`` (:meth:`over_step`).

    ``embedding_bwd``, ``loss_fwd`` and ``loss_bwd`` are each their least over a step's
    micro-batches, so every sum of them is a floor of the step's compute; :meth:`over_step`
    gives the averages.
        final_norm_fwd, final_norm_bwd: the last norm.
        optimizer: AdamW + clipping over the local shards, per step.
        selective: one block's extra seconds under selective checkpointing (the norm applies,
            RoPE and the activation, once each; memory bound).
        attention, attention_bwd: one block's attention core (SDPA), forward and backward
            seconds (included in ``post_fwd`` / ``post_bwd``; the context overlap hides the
            K/V pieces behind them, :func:`tetrad.plan.comm.layers.context_kv`).
        rope_q, rope_q_bwd: one block's RoPE of the queries, forward and backward seconds
            (included in ``post_fwd`` / ``post_bwd``; the model forms the queries after
            handing over the keys and values, so the K/V all-gather runs behind the forward
            and its reduce-scatter behind the backward; 0 for GPT).
        casts: one block's FP8 casts per micro-batch, seconds (included in ``gemm``, a third
            to each GEMM of their Linear: :mod:`tetrad.plan.compute.fp8`; 0 without FP8).
    """

    gemm: tuple[float, ...]
    gemm_flops: tuple[float, ...]
    post_fwd: tuple[float, ...]
    post_bwd: tuple[float, ...]
    head: float
    head_flops: float
    loss_fwd: float
    loss_bwd: float
    embedding_fwd: float
    embedding_bwd: float
    final_norm_fwd: float
    final_norm_bwd: float
    optimizer: float
    selective: float = 0.0
    head_dw_blocks: float = 0.0
    head_dw_scale: float = 0.0
    attention: float = 0.0
    attention_bwd: float = 0.0
    rope_q: float = 0.0
    rope_q_bwd: float = 0.0
    casts: float = 0.0
    embedding_zero: float = 0.0

    def over_step(self, acc: int, gz: int) -> BlockCompute:
        """The per-micro-batch average over a step of ``acc`` micro-batches. With ``G_z = 1``
        every micro-batch after the first adds into the gradients in place
        (tetrad/parallel/overlap.py, ``grad_to_add_into``): the embedding's rows go into the
        table without zeroing it (``embedding_zero`` on the first only), and every micro-batch's
        LM head ``dW`` GEMMs write or add into the fp32 gradient in forward, scaled by the
        loss's known gradient (tetrad/parallel/loss.py; nothing element-wise, and nothing to
        hide the head's Y all-reduce: ``head_dw_scale`` 0). With ``G_z > 1`` every
        micro-batch forms its full-block gradients apart (``embedding_zero``, the ``dW`` sum
        and its scaling on each)."""
        if gz > 1:
            return replace(
                self,
                embedding_bwd=self.embedding_bwd + self.embedding_zero,
                loss_fwd=self.loss_fwd + self.head_dw_blocks,
                loss_bwd=self.loss_bwd + self.head_dw_scale,
            )
        return replace(
            self, embedding_bwd=self.embedding_bwd + self.embedding_zero / acc, head_dw_scale=0.0
        )

    @property
    def block_fwd(self) -> float:
        """One block's forward (or recompute) seconds."""
        return sum(self.gemm) + sum(self.post_fwd)

    @property
    def block_bwd(self) -> float:
        """One block's backward seconds (dx and dW GEMMs, element-wise backward)."""
        return 2.0 * sum(self.gemm) + sum(self.post_bwd)

    def micro_batch_seconds(
        self, n_layers: int, checkpointing: str | bool
    ) -> tuple[float, float, float]:
        """``(forward, backward, recompute)`` seconds of one micro-batch; ``checkpointing``:
        ``none``, ``selective``, ``selective:K`` or ``full`` (a bool: ``full``/``none``);
        recompute is ``L`` block forwards (full), ``K`` :attr:`selective` (``K = L`` for
        selective) or 0.

        Raises:
            tetrad.spec.activation_checkpointing.CheckpointingError: an unknown mode.
        """
        fwd = (
            n_layers * self.block_fwd
            + self.embedding_fwd
            + self.final_norm_fwd
            + 3.0 * self.head
            + self.loss_fwd
        )
        bwd = n_layers * self.block_bwd + self.embedding_bwd + self.final_norm_bwd + self.loss_bwd
        mode, k = checkpointed_blocks(checkpointing, n_layers)
        per_block = {"full": self.block_fwd, "selective": self.selective, "none": 0.0}[mode]
        return fwd, bwd, k * per_block


def _post_slots(model: ModelSpec) -> tuple[int, int]:
    """Indices of the block Linears followed by the attention core and by the activation: the
    ones just before the first and the second transposed Linear."""
    lins = model.linears()
    t = [i for i, lin in enumerate(lins) if lin.transposed]
    return t[0] - 1, t[1] - 1


def block_compute(
    model: ModelSpec,
    machine: Machine,
    grid: tuple[int, int, int, int],
    micro_batch: int,
    seq_len: int,
    *,
    local_params: float = 0.0,
    linears=None,
    gemm_efficiency=None,
    fp8: str = "off",
    fp8_efficiency=None,
    fp8_casts: bool = True,
    sequence_split: int = 1,
) -> BlockCompute:
    """Compute times of one rank on ``grid = (G_data, [G_context,] G_z, G_y, G_x)``; see the
    module doc (context parallelism: ``m = b S / G_context`` and
    :func:`tetrad.plan.compute.flops.attention_fwd_flops`).

    Args:
        local_params: this rank's parameter elements (for the optimizer time).
        linears: ``model.linears()`` (pass it when calling in a loop).
        gemm_efficiency: a callable flops -> fraction (default: the machine's table).
        fp8: the FP8 recipe (:data:`tetrad.plan.compute.fp8.FP8_RECIPES`): the block Linears
            it converts run at the machine's FP8 rate with their casts
            (:func:`tetrad.plan.compute.fp8.fp8_gemm`); the LM head stays in the compute dtype.
        fp8_efficiency: a callable flops -> fraction of the FP8 peak (default: the machine's
            FP8 table).
        fp8_casts: count the FP8 casts (False: GEMMs only, for a lower bound that must not
            grow with the micro-batch's share of a weight's cast).
        sequence_split: the residual stream's split along the sequence over Y (``G_y`` under
            sequence parallelism, :meth:`tetrad.plan.question.StepQuestion.sequence_split`;
            1 without): the norms and residual adds (the final norm and the selective
            recompute's norm applies too) run on ``m / sequence_split`` tokens.
    """
    _, gc, _, gy, gx = with_context(grid)
    lins = linears if linears is not None else model.linears()
    eff = gemm_efficiency or machine.gemm_efficiency
    peak, hbm = machine.peak_flops, machine.hbm_bytes_per_s
    m = micro_batch * local_seq_len(seq_len, gc)
    txy = gx * gy
    gemm, flops, casts = [], [], 0.0
    for lin in lins:
        f = 2.0 * m * lin.out_features * lin.in_features * lin.count / txy
        flops.append(f)
        if fp8 != "off" and converts(lin, fp8):
            t, c = fp8_gemm(lin, f, m, gx, gy, machine, fp8_efficiency, fp8_casts, fp8)
            gemm.append(t)
            casts += c
        else:
            gemm.append(f / (peak * eff(f)) if f else 0.0)
    ew = ELEMENTWISE
    hx, fy = model.dim / gx, model.ffn_dim / gy
    qk = (model.q_dim + model.kv_dim) / gy
    att = attention_fwd_flops(model, micro_batch, seq_len, gy, gc) / (
        peak * machine.attention_efficiency
    )
    rope = 0.0 if model.family == "gpt" else ew["rope_per_qk"] * m * qk / hbm
    rope_q = rope * model.q_dim / (model.q_dim + model.kv_dim)
    act = (ew["act_per_f_gpt"] if model.family == "gpt" else ew["act_per_f_llama"]) * m * fy / hbm
    half_norm = 0.5 * ew["norm_residual_per_h"] * m * hx / sequence_split / hbm
    i_att, i_act = _post_slots(model)
    post = [0.0] * len(lins)
    post_b = [0.0] * len(lins)
    for i, lin in enumerate(lins):
        if lin.transposed:
            post[i] += half_norm
            post_b[i] += ew["backward_factor"] * half_norm
    post[i_att] += att + rope
    post_b[i_att] += ATTENTION_BWD * att + ew["backward_factor"] * rope
    post[i_act] += act
    post_b[i_act] += ew["backward_factor"] * act
    head = model.lm_head()
    hf = 2.0 * m * head.out_features * head.in_features / txy
    vy = model.vocab_size // txy  # logits per rank: the LM head splits V over Y and X
    blocks = loss_blocks(vy, m)  # row blocks of the fused loss (GPU budget)
    per_logit = ew["loss_fwd_per_logit"]  # with V split too (tetrad/parallel/loss.py)
    dw_el = vy * model.dim
    dw_scale = ew["loss_bwd_per_dw"] * dw_el / hbm
    emb_rows = (model.vocab_size + model.max_positions) / gy
    return BlockCompute(
        gemm=tuple(gemm),
        gemm_flops=tuple(flops),
        post_fwd=tuple(post),
        post_bwd=tuple(post_b),
        head=hf / (peak * eff(hf)),
        head_flops=hf,
        loss_fwd=per_logit * m * vy / hbm,
        loss_bwd=ew["loss_bwd_per_dx"] * m * model.dim / hbm,
        embedding_fwd=8.0 * m * hx / hbm,
        embedding_bwd=8.0 * m * hx / hbm,
        final_norm_fwd=half_norm / 2.0,
        final_norm_bwd=ew["backward_factor"] * half_norm / 2.0,
        optimizer=ew["optimizer_per_param"] * local_params / hbm,
        selective=half_norm + rope + act,  # two norm applies = one half_norm
        head_dw_blocks=ew["loss_dw_per_block"] * (blocks - 1) * dw_el / hbm,
        head_dw_scale=dw_scale,
        attention=att,
        attention_bwd=ATTENTION_BWD * att,
        rope_q=rope_q,
        rope_q_bwd=ew["backward_factor"] * rope_q,
        casts=casts,
        embedding_zero=4.0 * emb_rows * hx / hbm,
    )
