"""Every classic Megatron-style configuration as a layout of tetrad's grid (issue 45: tetrad's
space contains the classic one).

A configuration of :mod:`tetrad.plan.search.classic` (``TP x CP x PP x DP``, virtual stages,
micro-batch, recomputation) becomes the tetrad layout with the same parallel sizes
(:func:`to_tetrad`):

- ``TP`` -> one tensor axis in the ``Y`` role, ``G_y = TP``, ``G_x = G_z = 1``: the pair's first
  Linear (wqkv, w13) splits its output and the second (wo, w2) its input, Megatron-LM's column-
  then row-parallel layout (``docs/architecture.md``, *Orientation*); ``Y`` is the fastest
  dimension of the 5D grid as TP is Megatron's fastest (rank order TP, CP, DP, PP). With
  ``TP > 1``, Megatron-LM's ``--sequence-parallel`` (Korthikanti et al., arXiv 2205.05198,
  section 4.2.2), which the classic model assumes (its all-gathers and reduce-scatters, and
  Fujii et al.'s activations all divided by ``TP``): tetrad's ``--sequence-parallel
  --sequence-parallel-regather`` (the residual stream and norms ``[b, S/(CP TP), h]``, each
  pair's first Linear keeping its input's sequence shard and all-gathering it again in
  backward, as Megatron-LM does), where tetrad has it
  (:func:`tetrad.spec.sharding.sequence_parallel_problem`: a dense model, ``S`` divisible by
  ``CP TP``); elsewhere without it (:attr:`TetradLayout.notes` says why). The classic time
  counts no re-gather in backward; tetrad's step model hides it behind the dx GEMM;
- ``CP`` -> ``G_context`` (tetrad's all-gathered K/V in pieces, where Megatron runs a ring);
- ``PP`` -> ``G_pipe`` (outermost, as Megatron's); ``v`` virtual stages -> ``interleaved-1f1b``
  with ``v`` stages per rank; ``v = 1`` -> ``1f1b`` where the step has at least ``PP``
  micro-batches, else ``gpipe`` (the planner's 1F1B needs ``m >= p``); the classic split (its
  even one, or Megatron-Core's uneven first/last counts) is the layout's ``--pipeline-split``,
  timed beside tetrad's own balanced split (``tetrad.spec.pipeline_split``);
- ``DP`` -> ``G_data``, with the sharded optimizer (ZeRO-1 over data x context, where that group
  is above 1) and bf16 weights with fp32 masters among the sharded states (``--param-dtype
  bf16``): Megatron-LM's distributed optimizer;
- the micro-batch is the same (samples per DP x CP rank = per (data, Z) cell at ``G_z = 1``);
- recomputation: ``none`` -> ``none``, ``full`` -> ``full``; Megatron's ``selective`` (the
  attention core, which FlashAttention never stores: the classic model treats it as ``none``)
  -> ``none``.

:func:`layout_estimate` times the layout with tetrad's step model
(:func:`tetrad.plan.step_time.estimate` or, with a pipeline,
:func:`tetrad.plan.pipe.pipeline_step.pipeline_estimate`) and its memory
(:func:`tetrad.plan.memory.runtime.runtime_memory`,
:func:`tetrad.plan.memory.pipeline.pipeline_memory`), sequence parallelism included, as
``tetrad plan --param-dtype bf16 --sequence-parallel on --sequence-parallel-regather`` would
rank it (``tests/test_classic_map.py`` compares both spaces on the cases of
``docs/planner.md`` section 6.1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tetrad.plan.memory.breakdown import MemoryBreakdown
from tetrad.plan.memory.pipeline import pipeline_memory
from tetrad.plan.memory.runtime import runtime_memory
from tetrad.plan.memory.states import param_bytes
from tetrad.plan.pipe.pipeline_step import PipeConfig, pipeline_estimate, split_ranks
from tetrad.plan.pipe.schedule import schedule_problems
from tetrad.plan.pipe.stages import ranks_of_split, split_costs
from tetrad.plan.question import StepQuestion, sharded
from tetrad.plan.search.memory_fits import sequence_parallel_memory
from tetrad.plan.search.rows import Row
from tetrad.plan.step_time import estimate
from tetrad.spec.activation_checkpointing import parse_checkpointing
from tetrad.spec.model import ModelSpec
from tetrad.spec.pipeline_split import split_of_blocks
from tetrad.spec.sharding import sequence_parallel_problem

CLASSIC_TO_TETRAD_MODE = {"none": "none", "selective": "none", "full": "full"}
"""Megatron-LM's recomputation -> tetrad's (module doc: Megatron's ``selective`` recomputes the
attention core only, which FlashAttention does not store)."""


@dataclass(frozen=True)
class ClassicConfig:
    """One configuration of the classic space (:mod:`tetrad.plan.search.classic`).

    Attributes:
        tp, cp, pp, dp: Megatron-LM's tensor, context, pipeline and data parallel sizes.
        micro_batch: samples per micro-batch of one DP x CP rank.
        checkpointing: ``none``, ``selective`` or ``full``.
        virtual_stages: interleaved 1F1B's chunks per pipeline rank (1: plain 1F1B).
        stage_layers: Megatron-Core's uneven split (empty: even).
    """

    tp: int
    cp: int
    pp: int
    dp: int
    micro_batch: int
    checkpointing: str
    virtual_stages: int = 1
    stage_layers: tuple[int, ...] = ()

    @classmethod
    def from_row(cls, row: Row) -> ClassicConfig:
        """The configuration of a classic :class:`~tetrad.plan.search.rows.Row`."""
        s = row.sizes
        return cls(
            s["tp"],
            s["cp"],
            s["pp"],
            s["dp"],
            row.micro_batch,
            parse_checkpointing(row.activation_checkpointing),
            row.virtual_stages,
            tuple(row.other_s.get("stage_layers", ())),
        )


@dataclass(frozen=True)
class TetradLayout:
    """A layout of tetrad's space (the options of ``tetrad train`` / ``tetrad memory``).

    Attributes:
        grid: ``(G_data, G_context, G_z, G_y, G_x)``, the 5D grid of ``GPUs / G_pipe`` ranks.
        orientation: ``xy`` (``--grid``'s Y plays the Y role).
        pipe: the pipeline (``G_pipe``, virtual stages, schedule); None without one.
        micro_batch: samples per micro-batch of one (data, Z) cell.
        checkpointing: ``none`` or ``full`` on every block.
        shard_optimizer: AdamW states (and the fp32 masters) sharded over data x context.
        params: the weights' stored format (``bf16`` with fp32 masters).
        sequence_parallel: Megatron-LM's sequence parallelism over Y (``--sequence-parallel
            --sequence-parallel-regather``, module doc): the residual stream ``[b,
            S/(G_context G_y), h]``, each pair's first Linear re-gathering its input in
            backward.
        classic_split: with a pipeline, the classic configuration's blocks per stage
            (Megatron-Core's uneven split, else its even one where the stages divide the
            blocks; empty otherwise), which ``--pipeline-split`` runs: :func:`layout_estimate`
            times it beside tetrad's own split and keeps the better that fits.
        notes: how the layout departs from the classic configuration (not compared).
    """

    grid: tuple[int, int, int, int, int]
    orientation: str
    pipe: PipeConfig | None
    micro_batch: int
    checkpointing: str
    shard_optimizer: bool
    params: str = "bf16"
    sequence_parallel: bool = False
    classic_split: tuple[int, ...] = ()
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def sequence_parallel_keyword(self) -> bool | str:
        """The models' ``sequence_parallel`` keyword of this layout (``"regather"`` with
        sequence parallelism, else False;
        :func:`tetrad.plan.search.memory_fits.sequence_parallel_memory`)."""
        return sequence_parallel_memory(self.sequence_parallel, regather=True)

    def memory_args(self, global_batch: int, split: tuple[int, ...] = ()) -> list[str]:
        """The options of ``tetrad memory --method tetrad`` that give this layout
        (``global_batch``: samples per step, for the pipeline's micro-batches; ``split``: the
        blocks per stage, :attr:`LayoutEstimate.split`, empty for tetrad's own)."""
        names = ("data", "context", "z", "y", "x")
        parts = [f"{n}={s}" for n, s in zip(names, self.grid, strict=True) if s > 1]
        if self.pipe is not None:
            parts.insert(0, f"pipe={self.pipe.pipe}")
        out = ["--grid", ",".join(parts) or "data=1", "--micro-batch", str(self.micro_batch)]
        out += ["--orientation", self.orientation, "--activation-checkpointing"]
        out += [self.checkpointing, "--param-dtype", self.params]
        if self.shard_optimizer:
            out.append("--shard-optimizer")
        if self.sequence_parallel:
            out += ["--sequence-parallel", "--sequence-parallel-regather"]
        if self.pipe is not None:
            m = global_batch // (self.grid[0] * self.grid[2] * self.micro_batch)
            out += ["--pipeline-schedule", self.pipe.schedule, "--num-microbatches", str(m)]
            out += ["--virtual-stages", str(self.pipe.virtual)]
            if split:
                out += ["--pipeline-split", ",".join(map(str, split))]
        return out


def to_tetrad(
    cfg: ClassicConfig, global_batch: int, model: ModelSpec, seq_len: int
) -> TetradLayout:
    """The tetrad layout with ``cfg``'s parallel sizes (module doc). ``global_batch``: samples
    per step (the schedule depends on the micro-batches per step, ``B / (DP b)``); ``model``
    and ``seq_len`` (tokens per sample): where tetrad's sequence parallelism runs
    (:func:`tetrad.spec.sharding.sequence_parallel_problem`)."""
    grid = (cfg.dp, cfg.cp, 1, cfg.tp, 1)
    notes = []
    sp = cfg.tp > 1
    if sp and (problem := sequence_parallel_problem(model, grid, seq_len)):
        sp = False
        notes.append(f"no sequence parallelism: {problem}")
    pipe = None
    if cfg.pp > 1:
        m = global_batch // (cfg.dp * cfg.micro_batch)
        if cfg.virtual_stages > 1:
            pipe = PipeConfig(cfg.pp, cfg.virtual_stages, "interleaved-1f1b")
        elif schedule_problems("1f1b", cfg.pp, 1, m):
            pipe = PipeConfig(cfg.pp, 1, "gpipe")
            notes.append(f"1F1B with {m} < PP micro-batches: gpipe")
        else:
            pipe = PipeConfig(cfg.pp, 1, "1f1b")
    split: tuple[int, ...] = ()
    if cfg.pp > 1:
        stages = cfg.pp * cfg.virtual_stages
        if cfg.stage_layers:
            split = tuple(cfg.stage_layers)
        elif model.n_layers % stages == 0:
            split = (model.n_layers // stages,) * stages
    mode = CLASSIC_TO_TETRAD_MODE[cfg.checkpointing]
    return TetradLayout(
        grid,
        "xy",
        pipe,
        cfg.micro_batch,
        mode,
        cfg.dp * cfg.cp > 1,
        "bf16",
        sp,
        split,
        tuple(notes),
    )


@dataclass(frozen=True)
class LayoutEstimate:
    """tetrad's prediction of a layout: ``step_s`` seconds per step, the (worst rank's) memory
    and whether it fits (80% of the GPU, ``docs/planner.md`` section 5); ``split``: the blocks
    per stage it was timed with, the classic one (``--pipeline-split``), or empty for tetrad's
    balanced split."""

    step_s: float
    memory: MemoryBreakdown
    estimate: object
    split: tuple[int, ...] = ()

    @property
    def fits(self) -> bool:
        """Within 80% of the GPU's memory."""
        return self.memory.fits


def layout_question(ctx: StepQuestion, layout: TetradLayout) -> StepQuestion:
    """``ctx`` with the layout's optimizer (:func:`tetrad.plan.question.sharded`); ``ctx``
    must carry the layout's weight bytes (``param_bytes=2`` for ``bf16``) and, where the layout
    runs sequence parallelism, ask for it with the re-gather
    (``StepQuestion(..., sequence_parallel="regather")``: its runtime splits the sequence over
    Y exactly where the layout does, :meth:`~tetrad.plan.question.StepQuestion.sequence_split`).

    Raises:
        ValueError: ``ctx`` models other weights or other sequence parallelism than the layout.
    """
    if ctx.param_bytes != param_bytes(layout.params):
        raise ValueError(
            f"the question stores {ctx.param_bytes}-byte weights, the layout {layout.params}"
        )
    _, gc, _, gy, gx = layout.grid
    asked = ctx.sequence_parallel if ctx.sequence_split(gc, gy, gx) > 1 else False
    if asked != layout.sequence_parallel_keyword:
        raise ValueError(
            f"the question runs sequence parallelism {asked!r} on this grid, the layout "
            f"{layout.sequence_parallel_keyword!r}: build it with sequence_parallel='regather'"
        )
    return sharded(ctx) if layout.shard_optimizer else ctx


def head_relieved(split: tuple[int, ...]) -> list[tuple[int, ...]]:
    """``split`` (blocks per stage, the last stage with the LM head) with one block moved from
    the last stage to each other stage in turn: ``len(split) - 1`` splits, none where the last
    stage has no block (it may be left with none: :mod:`tetrad.spec.pipeline_split`). The head
    and loss weigh about two blocks of a large Llama, so the stage holding them is the slowest
    of an even split; Megatron-Core's ``--decoder-last-pipeline-num-layers`` takes blocks off it
    the same way."""
    if len(split) < 2 or split[-1] < 1:
        return []
    out = []
    for j in range(len(split) - 1):
        moved = list(split)
        moved[-1] -= 1
        moved[j] += 1
        out.append(tuple(moved))
    return out


def layout_estimate(
    ctx: StepQuestion, layout: TetradLayout, gpu_memory_bytes: float, dtype: str = "bf16"
) -> LayoutEstimate:
    """tetrad's step time (seconds) and memory of ``layout`` on ``ctx`` (built with
    ``param_bytes=2`` for bf16 weights and ``sequence_parallel="regather"``,
    :func:`layout_question`), as the 4D search would time it. With a pipeline, under tetrad's
    balanced split and, where the layout has one, the classic split (``--pipeline-split``) and
    the classic split with one block moved from the LM head's stage to any other stage
    (:func:`head_relieved`): the one that fits, the fastest among those that fit (or among all
    where none does).

    Raises:
        ValueError: ``ctx`` does not model the layout's weights or sequence parallelism.
    """
    q = layout_question(ctx, layout)
    model, b, mode = ctx.model, layout.micro_batch, layout.checkpointing
    sp = layout.sequence_parallel_keyword
    if layout.pipe is None:
        est = estimate(q, layout.grid, b, mode, orientation=layout.orientation)
        mem = runtime_memory(
            model,
            layout.grid,
            b,
            ctx.seq_len,
            gpu_memory_bytes,
            activation_checkpointing=mode,
            dtype=dtype,
            shard_optimizer=layout.shard_optimizer,
            params=layout.params,
            sequence_parallel=sp,
        )
        return LayoutEstimate(est.step_s, mem, est)
    cfg = layout.pipe
    m = ctx.global_batch // (layout.grid[0] * layout.grid[2] * b)
    splits: list[tuple[int, ...]] = [()]
    if layout.classic_split:
        splits += [layout.classic_split, *head_relieved(layout.classic_split)]
    best = None
    for split in splits:  # tetrad's balanced split, then the classic ones
        if split:
            stages = split_of_blocks(split, model.n_layers)
            ranks = ranks_of_split(stages, cfg.pipe, cfg.virtual)
        else:
            costs = split_costs(ctx.compute(layout.grid, b), mode)
            ranks = split_ranks(model.n_layers, costs, cfg.pipe, cfg.virtual)
        est = pipeline_estimate(q, cfg, layout.grid, b, mode, layout.orientation, ranks)
        mem, _ = pipeline_memory(
            model,
            layout.grid,
            b,
            ctx.seq_len,
            gpu_memory_bytes,
            ranks,
            cfg.schedule,
            cfg.virtual,
            m,
            activation_checkpointing=mode,
            dtype=dtype,
            shard_optimizer=layout.shard_optimizer,
            params=layout.params,
            sequence_parallel=sp,
        )
        got = LayoutEstimate(est.step_s, mem, est, split)
        if best is None or (got.fits, -got.step_s) > (best.fits, -best.step_s):
            best = got
    return best
