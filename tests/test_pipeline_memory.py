"""The planner's per-rank memory of pipeline grids against what each pipeline rank of the
runtime really allocates, saves and holds (:func:`tetrad.plan.memory.pipeline.pipeline_memory`).

On gloo ranks (CPU, fp32), for pipeline grids of 2 and 4 ranks (alone and with data, context,
Z, Y or X; GPipe, 1F1B, interleaved 1F1B; checkpointing none, full and selective), every rank
measures over the second training step (the first also infers the boundary shapes), for its
stages:

- parameter bytes: its parts' parameters' ``nbytes``;
- gradient bytes: ``.grad`` ``nbytes`` when the optimizer step begins;
- optimizer-state bytes: AdamW's ``exp_avg`` + ``exp_avg_sq`` after the step;
- peak saved activations: the most bytes of unique storages held for backward at once. Every
  tensor autograd saves in forward is packed into a :class:`_Held`, whose lifetime is the saved
  reference (autograd drops it when the node's backward runs); parameters are left out, and so
  are tensors saved during backward (full's and selective's recomputation: the planner's
  ``recompute_activations``). Under ``selective`` the blocks' kept tensors are packed by
  :mod:`tetrad.models.recompute`'s own hook, which is wrapped the same way;
- receive buffers after the step: none (:class:`tetrad.pipeline.stage.TetradStage` allocates
  each when its receive is posted and releases it after its micro-batch's backward);
- peak held: the most bytes of saved storages, receive buffers and the stage outputs that the
  stages keep for their backward (``fwd_cache``), unique storages, at once, sampled whenever a
  tensor is saved, a forward ends or a receive is posted.

Model states and the saved peak must equal the planner's to the byte (its rank breakdown's
components and :func:`tetrad.plan.memory.pipeline.in_flight_bytes`; in the breakdown the saved
peak is ``activations`` up to the end of backward, with the LM head's saved weight gradient of
the current micro-batch in ``logits_and_loss`` where ``G_z > 1`` keeps one (with ``G_z = 1``
training puts it into the gradient in forward); the rest is ``pipeline_buffers``). The held
peak is never above the planner's, and below it by at most the receives the planner counts as
posted ahead (one boundary tensor ``[b, S/G_context, h/G_x]`` per stage and direction the rank
receives in): at the peak torch has not always posted them yet (and in fp32 one may be the very
tensor the first block saves). Under GPipe and 1F1B a gloo rank posts all of a step's receives
of a direction at its first pass, up to ``m - 1`` boundary tensors per direction above the
planner's (NCCL) model (:func:`_posted_ahead`).
"""

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import _ComputationType

from tests.distributed import run_distributed
from tetrad.grid import Grid
from tetrad.models import recompute
from tetrad.parallel import init_parameters
from tetrad.pipeline.schedule import Pipeline
from tetrad.pipeline.step import pipeline_train_step
from tetrad.plan.memory.activations import saved_activations
from tetrad.plan.memory.pipeline import (
    HEAD_PHASES,
    in_flight_bytes,
    in_flight_sets,
    interleaved_order,
    pipeline_memory,
)
from tetrad.plan.pipe.schedule import boundaries_of_rank, in_flight_chunks, p2p_bytes
from tetrad.plan.pipe.stages import ranks_of_split
from tetrad.spec.grid import Axis
from tetrad.spec.pipeline_split import split_of_blocks
from tetrad.spec.precision import DTYPE_BYTES, precision
from tetrad.spec.presets import PRESETS
from tetrad.train.step import build_optimizer

CFG = dataclasses.replace(PRESETS["tiny"], n_layers=4)
MICRO, SEQ, SEED = 2, 16, 3
CASES = {  # (pipe, (G_data, G_context, G_z, G_y, G_x), schedule, virtual, micro-batches, mode)
    2: [
        (2, (1, 1, 1, 1, 1), "1f1b", 1, 4, "none"),
        (2, (1, 1, 1, 1, 1), "gpipe", 1, 3, "full"),
        (2, (1, 1, 1, 1, 1), "interleaved-1f1b", 2, 4, "none"),
        (2, (1, 1, 1, 1, 1), "interleaved-1f1b", 2, 4, "full"),
        # bf16 autocast: what crosses a boundary is bf16 (CPU's SDPA returns its output
        # heads-major, one more saved copy per plain block than CUDA's, which the planner
        # describes: so full and selective, whose blocks keep no SDPA output); "bf16" under
        # plain torch.autocast, an fp32 residual stream (the stages cast what they receive);
        # "bf16-stream" under the step's autocast with the CUDA policy, a bf16 stream (no cast)
        (2, (1, 1, 1, 1, 1), "1f1b", 1, 4, "full", "bf16"),
        (2, (1, 1, 1, 1, 1), "interleaved-1f1b", 2, 4, "selective", "bf16"),
        (2, (1, 1, 1, 1, 1), "1f1b", 1, 4, "full", "bf16-stream"),
        (2, (1, 1, 1, 1, 1), "interleaved-1f1b", 2, 4, "selective", "bf16-stream"),
    ],
    4: [
        (4, (1, 1, 1, 1, 1), "1f1b", 1, 4, "none"),
        (2, (1, 1, 2, 1, 1), "1f1b", 1, 2, "full"),
        (2, (2, 1, 1, 1, 1), "gpipe", 1, 2, "none"),
        (2, (1, 1, 1, 2, 1), "interleaved-1f1b", 2, 2, "selective"),
        (2, (1, 2, 1, 1, 1), "1f1b", 1, 2, "none"),
        (2, (1, 2, 1, 1, 1), "interleaved-1f1b", 2, 2, "none"),
        (2, (1, 1, 1, 1, 2), "interleaved-1f1b", 2, 4, "full"),
        # the LM head's stage without blocks (tetrad.spec.pipeline_split), alone on its rank
        # and beside another stage
        (2, (2, 1, 1, 1, 1), "1f1b", 1, 2, "none", "fp32", (4, 0)),
        (2, (1, 1, 2, 1, 1), "interleaved-1f1b", 2, 2, "selective", "fp32", (1, 1, 2, 0)),
    ],
}
STATES = ("parameters", "gradients", "optimizer_states")


class _Held:
    """A saved tensor as autograd keeps it: its storage counts while autograd holds this."""

    __slots__ = ("live", "key", "t")

    def __init__(self, live: "LiveBytes", t: torch.Tensor, key: int):
        self.live, self.key, self.t = live, key, t

    def __del__(self):
        self.live.release(self.key)


def _unpack(packed):
    return packed.t if isinstance(packed, _Held) else packed


class LiveBytes:
    """Bytes of the unique storages autograd holds for backward now (:attr:`now`), at most
    (:attr:`saved_peak`), and at most together with the storages ``others()`` gives
    (``{data_ptr: nbytes}``: buffers the schedule holds), :attr:`held_peak`. Parameters
    (``exclude``) and tensors saved during backward are left out."""

    def __init__(self, exclude: set[int], others):
        self.exclude, self.others = exclude, others
        self.refs: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.now = self.saved_peak = self.held_peak = 0

    def pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.exclude or not st.nbytes() or torch._C._current_graph_task_id() != -1:
            return t
        if key not in self.refs:
            self.refs[key], self.size[key] = 0, st.nbytes()
            self.now += st.nbytes()
            self.saved_peak = max(self.saved_peak, self.now)
            self.sample()
        self.refs[key] += 1
        return _Held(self, t, key)

    def sample(self) -> None:
        """Update :attr:`held_peak` with what is alive now."""
        extra = sum(n for k, n in self.others().items() if k not in self.refs)
        self.held_peak = max(self.held_peak, self.now + extra)

    def release(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.now -= self.size.pop(key)

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack)
        self._ctx.__enter__()
        self._inner = inner_pack, inner_unpack = recompute._pack, recompute._unpack

        def pack(t):  # selective mode's hook: wrap what it keeps as it is
            out = inner_pack(t)
            return self.pack(t) if out is t else out

        recompute._pack = pack
        recompute._unpack = lambda p: inner_unpack(_unpack(p))
        return self

    def __exit__(self, *exc):
        recompute._pack, recompute._unpack = self._inner
        self._ctx.__exit__(*exc)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _storages(tensors) -> dict[int, int]:
    out = {}
    for t in tensors:
        st = t.untyped_storage()
        out[st.data_ptr()] = st.nbytes()
    return out


def _recv_buffers(stages) -> list[torch.Tensor]:
    """The stages' receive buffers (one per micro-batch and direction)."""
    return [b for s in stages for b in s.recv_buffers()]


def _held(stages) -> dict[int, int]:
    """Storages the stages hold besides saved tensors: receive buffers, kept outputs."""
    outputs = [t for s in stages for out, _ in s.fwd_cache.values() for t in out]
    return _storages(_recv_buffers(stages) + outputs)


class _Recording:
    """The optimizer, recording the gradient bytes when its step begins."""

    def __init__(self, opt: torch.optim.Optimizer, params: list):
        self.opt, self.params, self.gradients = opt, params, None

    def step(self):
        assert all(p.grad is not None for p in self.params)
        self.gradients = _nbytes(p.grad for p in self.params)
        self.opt.step()

    def zero_grad(self, set_to_none: bool = True):
        self.opt.zero_grad(set_to_none=set_to_none)


def _sampling(forward, live: LiveBytes):
    """``forward_one_chunk`` that samples the held bytes once the stage keeps its output."""

    def run(*args, **kwargs):
        out = forward(*args, **kwargs)
        live.sample()
        return out

    return run


def _order(pipeline: Pipeline, rank: int) -> list[tuple[bool, int]]:
    """``(forward, local stage)`` of each chunk pass the interleaved schedule runs on ``rank``."""
    pipe = pipeline.grid.pipe
    ops = [a for a in pipeline.schedule.pipeline_order[rank] if a is not None]
    return [(a.computation_type == _ComputationType.FORWARD, a.stage_index // pipe) for a in ops]


def _measure(pipe, sizes, schedule, virtual, m, mode, dtype="fp32", blocks=None) -> dict:
    grid = Grid.build(sizes, pipe=pipe)
    split = split_of_blocks(blocks, CFG.n_layers) if blocks else None
    pipeline = Pipeline(CFG, grid, schedule, virtual, m, split, activation_checkpointing=mode)
    for part in pipeline.parts:
        init_parameters(part, SEED, grid)
    params = list(pipeline.parts.parameters())
    # "bf16-stream": the step runs under the CUDA policy (fp32 weights, bf16 GEMMs and stream)
    policy = precision("cuda") if dtype == "bf16-stream" else None
    opt = _Recording(build_optimizer(pipeline.parts, 1e-3, weight_decay=0.1, policy=policy), params)
    g = torch.Generator().manual_seed(SEED)
    batch = torch.randint(0, CFG.vocab_size, (m * MICRO * grid.data * grid.z, SEQ + 1), generator=g)

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")

    with autocast():
        pipeline_train_step(pipeline, opt, batch, 1.0)  # the first step also infers the shapes
    live = LiveBytes(set(_storages(params)), lambda: _held(pipeline.stages))
    for stage in pipeline.stages:
        stage.forward_one_chunk = _sampling(stage.forward_one_chunk, live)
        # receive buffers come to life when their receives are posted
        stage.get_fwd_recv_ops = _sampling(stage.get_fwd_recv_ops, live)
        stage.get_bwd_recv_ops = _sampling(stage.get_bwd_recv_ops, live)
        # receive buffers come to life when their receives are posted
        stage.get_fwd_recv_ops = _sampling(stage.get_fwd_recv_ops, live)
        stage.get_bwd_recv_ops = _sampling(stage.get_bwd_recv_ops, live)
    with live, autocast():
        pipeline_train_step(pipeline, opt, batch, 1.0)
    assert live.now == 0, f"{live.now} saved bytes outlive the step"
    states = [opt.opt.state[p] for p in params]
    rank = grid.coord[Axis.PIPE]
    return {
        "rank": rank,
        "split": pipeline.split,
        "order": _order(pipeline, rank) if virtual > 1 else None,
        "parameters": _nbytes(params),
        "gradients": opt.gradients,
        "optimizer_states": _nbytes(s[k] for s in states for k in ("exp_avg", "exp_avg_sq")),
        "saved_peak": live.saved_peak,
        "recv_buffers": _nbytes(_recv_buffers(pipeline.stages)),  # after the step
        "held_peak": live.held_peak,
    }


def _name(case) -> str:
    pipe, sizes, schedule, virtual, m, mode, *rest = case
    name = f"p{pipe}_{'-'.join(map(str, sizes))}_{schedule}_v{virtual}_m{m}_{mode}"
    return "_".join([name, *(r if isinstance(r, str) else "-".join(map(str, r)) for r in rest)])


def _worker(world_size: int, out_dir: str) -> None:
    for case in CASES[world_size]:
        result = _measure(*case)
        with open(f"{out_dir}/{_name(case)}_{dist.get_rank()}.json", "w") as fh:
            json.dump(result, fh)


def planned(case, split, rank: int) -> dict:
    """The planner's bytes of pipeline rank ``rank`` for ``case`` on the runtime's ``split``."""
    pipe, sizes, schedule, virtual, m, mode, *rest = case
    dtype = rest[0] if rest else "fp32"
    # plain torch.autocast keeps an fp32 stream; the step's autocast a bf16 one (the default)
    residual = "fp32" if dtype != "bf16-stream" else None
    dtype = dtype.removesuffix("-stream")
    spec = CFG
    opts = {"activation_checkpointing": mode, "dtype": dtype, "residual": residual}
    ranks = ranks_of_split(split, pipe, virtual)
    _, per = pipeline_memory(spec, sizes, MICRO, SEQ, 1e9, ranks, schedule, virtual, m, **opts)
    mem, prank = per[rank], ranks[rank]
    saved, held, persistent = in_flight_bytes(
        spec, sizes, MICRO, SEQ, prank, schedule, pipe, m, (mode, dtype, True), False, residual
    )
    out = {k: mem.components[k] for k in STATES}
    out.update(saved_peak=saved, recv_buffers=0, held_peak=saved + held + persistent)
    boundary = p2p_bytes(MICRO, SEQ, CFG.dim, sizes[-4], sizes[-1], DTYPE_BYTES[dtype])
    out["posted"] = sum(boundaries_of_rank(pipe, rank, virtual)) * boundary
    # the breakdown carries them: activations (+ the head's saved weight gradient of the
    # current micro-batch in its phases) and pipeline_buffers, at every phase up to backward
    phase = mem.peak_phase.partition(": ")[2]
    head = saved_activations(spec, sizes, MICRO, SEQ, **opts)["loss"] if phase in HEAD_PHASES else 0
    out["peak_phase"], out["peak_activations"] = phase, mem.components["activations"] + head
    out["peak_buffers"] = mem.components["pipeline_buffers"]
    return out


MEASURED = ("saved_peak", "recv_buffers", "held_peak", *STATES)


def _posted_ahead(case, rank: int) -> int:
    """Bytes a gloo rank may hold beyond the planner's model: under GPipe and 1F1B a stage
    posts every micro-batch's receive of a direction at that direction's first pass
    (``LeanRecvStage.post_ahead``), up to ``m - 1`` more boundary tensors per direction it
    receives in than the one posted ahead that the planner counts (its model is of NCCL
    ranks, which post as torch does). Under GPipe the forward's are all alive at its peak in
    any case, so only the gradients' count."""
    pipe, sizes, schedule, _, m, _, *rest = case
    if schedule not in ("gpipe", "1f1b"):
        return 0
    directions = int(rank < pipe - 1) + int(schedule == "1f1b" and rank > 0)
    dtype = (rest[0] if rest else "fp32").removesuffix("-stream")
    boundary = p2p_bytes(MICRO, SEQ, CFG.dim, sizes[-4], sizes[-1], DTYPE_BYTES[dtype])
    return directions * (m - 1) * boundary


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_pipeline_memory_matches_runtime(world_size, tmp_path):
    run_distributed(_worker, world_size, world_size, str(tmp_path))
    for case in CASES[world_size]:
        for grid_rank in range(world_size):
            got = json.loads((tmp_path / f"{_name(case)}_{grid_rank}.json").read_text())
            rank, split = got["rank"], [tuple(s) for s in got["split"]]
            want = planned(case, split, rank)
            line = ", ".join(f"{k} {got[k]}/{want[k]:.0f}" for k in MEASURED)
            if grid_rank == rank * world_size // case[0]:  # the first of each pipeline rank
                print(f"{_name(case)} rank {rank} measured/planned bytes: {line}")
            slack = {"held_peak": want["posted"]}  # receives not posted yet (module doc)
            over = {"held_peak": _posted_ahead(case, rank)}
            for k in MEASURED:
                low = want[k] - slack.get(k, 0)
                high = want[k] + over.get(k, 0)
                assert low <= got[k] <= high, f"{_name(case)} rank {rank} {k}: {line}"
            if want["peak_phase"] not in ("backward: end", "optimizer step"):
                assert want["peak_buffers"] == want["held_peak"] - want["saved_peak"]
            if want["peak_phase"] != "backward: blocks" or rank < case[0] - 1:
                assert want["peak_activations"] == want["saved_peak"], want
            if got["order"] is not None:  # torch's interleaved order, as the planner plays it
                _, _, _, v, m, *_ = case
                assert [tuple(o) for o in got["order"]] == list(
                    interleaved_order(case[0], rank, v, m)
                )


@pytest.mark.parametrize("pipe", [2, 3, 4, 8])
@pytest.mark.parametrize("virtual", [2, 3, 5])
def test_interleaved_in_flight_sets_reach_the_planners_count(pipe, virtual):
    """Playing torch's interleaved order out reaches :func:`in_flight_chunks` passes at most,
    on every rank and micro-batch count."""
    for m in range(pipe, 4 * pipe + 1, pipe):
        for r in range(pipe):
            sets = in_flight_sets("interleaved-1f1b", pipe, r, virtual, m)
            assert max(map(sum, sets)) == in_flight_chunks("interleaved-1f1b", pipe, r, virtual, m)
            assert all(len(c) == virtual and min(c) >= 0 for c in sets)
