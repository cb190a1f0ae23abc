"""The Llama of :mod:`tetrad.models.llama` on the 4D grid: the layer factory that builds it from
the 3D tensor-parallel layers, and the model it gives.

Layouts on the grid (AxoNN's algorithm, Singh et al., arXiv 2305.13525):

    (S: this rank's S/G_context tokens of each sequence, :mod:`tetrad.parallel.context`)
    residual stream       [B/(G_data G_z), S, h/G_x]         replicated over Y
    q / k / v, attention  [B/(G_data G_z), S, heads/G_y, d]  (wqkv: in X, out Y; each Y rank
                                                               holds whole KV groups)
    attention out-proj    transposed (in Y, out X) -> back to the residual layout
    SwiGLU                w13 (gate and up stacked, [2, f, h]): in X, out Y, its output
                          G_z pieces of [gate, up]; w2 transposed (in Y, out X)
    logits                [B/(G_data G_z), S, V/(G_y G_x)]     (LM head: input gathered over X,
                                                               vocabulary over Y and X)
    MoE router            whole on every rank, its gradient summed over Z and data like the
                          norm weights', and over Y and X on tensor grids, where each tensor
                          rank routes its own slice of the tokens, whole
                          (:mod:`tetrad.parallel.moe_tensor`)
    MoE experts           [E/G_expert, ...] on the expert axis (folded over the stage's
                          ranks, :mod:`tetrad.parallel.experts`), gradients summed over
                          expert-data; whole on every rank when G_expert = 1
    q/k head norms        whole on every rank, gradients summed over Z, data and Y (heads)

With ``sequence_parallel`` (``G_y > 1``) the residual stream, the norms and the residual adds
are split along the sequence over Y instead of replicated, ``[B/(G_data G_z), S/G_y, h/G_x]``;
each pair gathers the sequence before its first layer and reduce-scatters it after its second,
the embedding reduce-scatters its output and the LM head gathers its input
(:mod:`tetrad.parallel.sequence`); norm weights' gradients are summed over Y too.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tetrad.comm import all_reduce
from tetrad.grid import Grid
from tetrad.models.llama import ModelPart, Transformer, attend_causally_to
from tetrad.models.meta import materialize
from tetrad.models.moe import GroupedExperts
from tetrad.parallel.context import ContextAttention, local_positions
from tetrad.parallel.embedding import Embedding
from tetrad.parallel.expert_grads import ExpertGradSums
from tetrad.parallel.experts import ExpertParallelExperts
from tetrad.parallel.head import VocabParallelHead
from tetrad.parallel.linear import Linear
from tetrad.parallel.loss import lm_head_loss
from tetrad.parallel.moe_tensor import TensorTokens
from tetrad.parallel.norm import RMSNorm
from tetrad.parallel.overlap import Overlap
from tetrad.parallel.placement import Placement
from tetrad.spec.grid import Axis, GridError
from tetrad.spec.model import ModelSpec
from tetrad.spec.overlap import DEFAULT_OVERLAPS
from tetrad.spec.sharding import check_grid, check_moe_grid, sequence_parallel_problem
from tetrad.torch_private import dynamo_counts


class ParallelLayers:
    """A :class:`tetrad.models.llama.Layers` factory of 3D tensor-parallel layers on ``grid``,
    sharing one :class:`Overlap`; attention heads are split over Y, sequences over context
    (:mod:`tetrad.parallel.context`); with ``sequence_parallel`` the residual stream split
    along the sequence over Y (:mod:`tetrad.parallel.sequence`), and with ``regather`` each
    pair's first Linear gathering its input again in backward instead of keeping it gathered."""

    def __init__(
        self,
        grid: Grid,
        overlap: Overlap,
        sequence_parallel: bool = False,
        regather: bool = False,
    ):
        self.grid, self.overlap = grid, overlap
        self.sequence_parallel, self.regather = sequence_parallel, regather
        # the residual stream holds 1/sequence_split of this rank's tokens of each sample
        self.sequence_split = grid.y if sequence_parallel else 1
        self.head_split = grid.y
        if grid.context == 1:
            self.attend_to = attend_causally_to
        else:
            self.attend_to = ContextAttention(grid, overlap.context_pieces).attend_to
        tensor = grid.y * grid.x > 1
        # MoE: each tensor rank routes a slice of the tokens (their gradients sum over Y, X)
        self.moe_tokens = TensorTokens(grid) if tensor else None
        self.token_axes = tuple(a for a in (Axis.Y, Axis.X) if grid.size(a) > 1)
        # the parts of each sequence over the ranks: the MoE router z-loss's whole length
        self.sequence_parts = grid.context * grid.y * grid.x
        if grid.context == 1 and not tensor:
            self.sequence_sum = None  # whole sequences on every rank

    def positions(self, s: int, device: torch.device) -> torch.Tensor:
        return local_positions(s, self.grid, device)

    def linear(
        self, k: int, n: int, *, transpose: bool = False, std: float = 0.02, stacked: int = 1
    ) -> nn.Module:
        return Linear(
            k,
            n,
            self.grid,
            transpose=transpose,
            init_std=std,
            overlap=self.overlap,
            sequence_parallel=self.sequence_parallel,
            regather=self.regather,
            stacked=stacked,
        )

    @property
    def stacked_pieces(self) -> int:
        """A stacked Linear's output comes in ``G_z`` pieces: its weight's Z all-gather
        concatenates the Z ranks' shards, each holding its rows of every stacked matrix."""
        return self.grid.z

    def embedding(self, vocab: int, dim: int) -> nn.Module:
        sp = self.sequence_parallel
        return Embedding(vocab, dim, self.grid, overlap=self.overlap, sequence_parallel=sp)

    def head(self, dim: int, vocab: int) -> nn.Module:
        sp = self.sequence_parallel
        return VocabParallelHead(dim, vocab, self.grid, overlap=self.overlap, sequence_parallel=sp)

    def norm(self, dim: int, eps: float) -> nn.Module:
        sum_axes = (Axis.Y,) if self.sequence_parallel else ()  # each Y rank: its tokens
        return RMSNorm(dim, self.grid, Axis.X, eps, sum_axes)

    def loss_sum(
        self,
        head: nn.Module,
        x: torch.Tensor,
        targets: torch.Tensor,
        vocab: int | None = None,
        grad_scale: float | None = None,
    ) -> torch.Tensor:
        return lm_head_loss(head, x, targets, vocab, grad_scale)  # the head and the loss fused

    def router(self, dim: int, n_experts: int) -> nn.Module:
        """The MoE router ``[T, dim] -> [T, E]``, weight ``[E, dim]`` whole on every rank."""
        return self._replicated(nn.Linear(dim, n_experts, bias=False), self.token_axes)

    def experts(self, n_experts: int, dim: int, ffn_dim: int, out_std: float) -> nn.Module:
        """The routed experts: split over the expert axis (:class:`ExpertParallelExperts`)
        when ``G_expert > 1``, else :class:`GroupedExperts` whole on every rank."""
        if self.grid.expert > 1:
            pieces = self.overlap.expert_pieces
            return ExpertParallelExperts(n_experts, dim, ffn_dim, out_std, self.grid, pieces)
        return self._replicated(GroupedExperts(n_experts, dim, ffn_dim, out_std), self.token_axes)

    @torch.compiler.disable  # collectives stay outside compiled graphs
    def sequence_sum(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t`` (no gradient) summed in place over the context ranks and the Y and X ranks,
        which hold the other parts of this rank's sequences (the MoE load-balancing
        statistics); with ``G_context = G_y = G_x = 1`` this attribute is None
        (:meth:`__init__`)."""
        for axis in (Axis.CONTEXT, Axis.Y, Axis.X):
            all_reduce(t, self.grid, axis)
        return t

    def head_norm(self, dim: int, eps: float) -> nn.Module:
        """Per-head q/k RMSNorm weight ``[head_dim]``, whole on every rank; each Y rank
        applies it to its own heads, so its gradient is summed over Y too."""
        heads = (Axis.Y,) if self.grid.y > 1 else ()
        return self._replicated(nn.RMSNorm(dim, eps=eps), heads)

    def _replicated(self, module: nn.Module, sum_axes: tuple[str, ...] = ()) -> nn.Module:
        """``module`` (built on meta, allocated with the model), every parameter placed whole
        on every rank (its gradient summed over Z, data and ``sum_axes`` by
        :func:`tetrad.parallel.grads.sync_gradients`)."""
        for p in module.parameters():
            p.placement = Placement(tuple(p.shape), (), sum_axes)
            if not hasattr(p, "init"):
                p.init = ("normal", 0.02) if p.dim() > 1 else ("ones",)
        return module


class ParallelLlama(Transformer):
    """The 3D tensor-parallel Llama on ``grid``: tokens ``[B/(G_data G_z), S/G_context]``
    (:func:`tetrad.parallel.context.split_sequence`) -> logits
    ``[B/(G_data G_z), S/G_context, V/(G_y G_x)]``. Built on the meta device, then each
    rank's shards are allocated on the grid's device (:mod:`tetrad.models.meta`), uninitialised:
    call :func:`tetrad.parallel.init_parameters`.

    Args:
        activation_checkpointing: a mode of
            :data:`tetrad.spec.activation_checkpointing.CHECKPOINTING`
            (or a bool).
        overlaps: names from :data:`tetrad.spec.overlap.OVERLAPS` (default: all but ``fine``).
        part: the slice of the model to build (a pipeline stage's); default the whole.
        sequence_parallel: split the residual stream along the sequence over Y
            (:mod:`tetrad.parallel.sequence`): the norms' and residual's activations divided by
            ``G_y``, each pair's all-reduce over Y replaced by an
            all-gather and a reduce-scatter of the same bytes.
        sequence_parallel_regather: with ``sequence_parallel``, each pair's first Linear
            (wqkv, w13) keeps its input's sequence shard ``[b, s/G_y, h/G_x]`` and all-gathers
            it again in backward, instead of keeping the gathered ``[b, s, h/G_x]``
            (Korthikanti et al., arXiv 2205.05198, section 4.2.2).
        overlap_options: ``bucket_bytes``, ``domino_min_rows``, ``fine_chunks`` and
            ``context_pieces`` of
            :class:`Overlap`.

    Attributes:
        overlap: the :class:`Overlap` the training step drives.

    Raises:
        GridError: a size of ``cfg`` that does not shard on ``grid`` (heads or KV heads
            by ``G_y``, a weight dimension by its axes), listing what to change; or
            ``sequence_parallel`` on a grid or model without it
            (:func:`tetrad.spec.sharding.sequence_parallel_problem`);
            ``sequence_parallel_regather`` without ``sequence_parallel``.
    """

    def __init__(
        self,
        cfg: ModelSpec,
        grid: Grid,
        activation_checkpointing: str | bool = "none",
        overlaps: Iterable[str] = DEFAULT_OVERLAPS,
        part: ModelPart | None = None,
        sequence_parallel: bool = False,
        sequence_parallel_regather: bool = False,
        **overlap_options: int,
    ):
        check_grid(cfg, grid.sizes)
        check_moe_grid(cfg, grid.sizes, grid.pipe, grid.expert)
        if sequence_parallel and (problem := sequence_parallel_problem(cfg, grid.sizes)):
            raise GridError(problem)
        if sequence_parallel_regather and not sequence_parallel:
            raise GridError(
                "sequence_parallel_regather gathers a sequence-parallel input again: "
                "turn on sequence_parallel, or drop sequence_parallel_regather"
            )
        overlap = Overlap(grid, overlaps, **overlap_options)
        layers = ParallelLayers(grid, overlap, sequence_parallel, sequence_parallel_regather)
        with torch.device("meta"):  # shapes only: each rank then allocates its own shards
            super().__init__(cfg, layers, activation_checkpointing, part)
        materialize(self, grid.device)
        self.overlap = overlap
        self._place_buffers(grid)
        # expert-sharded weights are summed over expert-data, never in the data buckets
        params = [p for p in self.parameters() if not p.placement.expert_sharded]
        overlap.late = [p for p in params if Axis.Z in p.placement.grad_sum_axes]
        if overlap.on("dp_all_reduce") and grid.expert > 1 and grid.size(Axis.EXPERT_DATA) > 1:
            experts = [m for m in self.modules() if isinstance(m, ExpertParallelExperts)]
            overlap.expert_sums = ExpertGradSums(grid, experts)
        overlap.buckets.expected = len(params) - len(overlap.late)
        if overlap.folds_late():  # backward meets the weights in reverse order
            late = {id(p) for p in overlap.late}
            order = [p for p in reversed(params) if id(p) not in late]
            overlap.buckets.plan(order, overlap.late)

    def _place_buffers(self, grid: Grid) -> None:
        """Move the buffers the model code made (MoE routers' selection biases) to the grid's
        device; each persistent one is whole on every rank (``placement``, so checkpoints save
        it)."""
        for module in self.modules():
            for name, b in list(module._buffers.items()):
                if b is None:
                    continue
                b = module._buffers[name] = b.to(grid.device)
                if name not in module._non_persistent_buffers_set:
                    b.placement = Placement(tuple(b.shape), ())


def compile_blocks(model: Transformer, backend: str = "inductor") -> None:
    """``torch.compile`` each transformer block in place (the granularity torchtitan uses).

    The parallel layers' collectives run eagerly (``torch.compiler.disable``), so each block's
    graphs are the computation between them: RMSNorm's arithmetic, RoPE, attention, SwiGLU's
    gate and the residual adds, fused by Inductor; the GEMMs stay cuBLAS (or the CPU BLAS).
    Every collective-bearing layer call is one graph break (count them with
    :func:`compile_stats`). ``backend``: torch.compile's (``aot_eager`` traces and
    differentiates the same graphs without generating code: the tests of Dynamo's side use it).
    """
    for block in model.layers.values():
        block.compile(backend=backend)


def compile_stats() -> dict[str, int]:
    """``{"graphs": ..., "graph_breaks": ...}`` compiled so far in this process
    (:func:`tetrad.torch_private.dynamo_counts`)."""
    return dynamo_counts()
