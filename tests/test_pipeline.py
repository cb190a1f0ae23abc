"""Pipeline grids against the single-process reference: losses, gradient norms and updated
weights of several AdamW steps (the tolerances of ``tests/test_model.py``), for each schedule
and composed with data, context, Z, Y and X."""

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open

from tests.distributed import run_distributed
from tests.test_model import (
    AOT_EAGER,
    BATCH,
    CLIP,
    LR,
    MICRO,
    OVERLAP_OPTIONS,
    SEED,
    SEQ,
    STEPS,
    reference_run,
)
from tests.test_orientation import _config, _losses, _run
from tetrad.grid import Grid
from tetrad.parallel import init_parameters
from tetrad.parallel.model import compile_blocks
from tetrad.pipeline.schedule import Pipeline
from tetrad.pipeline.step import pipeline_train_step
from tetrad.plan.pipe.schedule import in_flight_chunks, p2p_bytes
from tetrad.spec.overlap import OVERLAPS
from tetrad.spec.pipeline_split import (
    PipelineSplitError,
    balanced_split,
    check_schedule,
    split_of_blocks,
)
from tetrad.spec.precision import DTYPE_BYTES
from tetrad.spec.presets import PRESETS
from tetrad.train.export import export
from tetrad.train.step import build_optimizer, lr_at

CFG = dataclasses.replace(PRESETS["tiny"], n_layers=4)


def batches():
    g = torch.Generator().manual_seed(SEED)
    return [torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


@pytest.fixture(scope="module")
def reference():
    return reference_run(CFG, batches())


def pipeline_runs(world_size, ref_curves, ref_weights, cases, compiled=False, options=None):
    """Each case against the reference (``options``: more :class:`ParallelLlama` options;
    ``compiled``: the torch.compile backend of every block, or False)."""
    for pipe, sizes, schedule, virtual, checkpointing, overlaps in cases:
        grid = Grid.build(sizes, pipe=pipe)
        m = BATCH // (grid.data * grid.z) // MICRO
        pipeline = Pipeline(
            CFG,
            grid,
            schedule,
            virtual,
            m,
            activation_checkpointing=checkpointing,
            overlaps=overlaps,
            **OVERLAP_OPTIONS,
            **(options or {}),
        )
        for part in pipeline.parts:
            init_parameters(part, SEED, grid)
            if compiled:
                compile_blocks(part, compiled)
        opt = build_optimizer(pipeline.parts, LR, weight_decay=0.1)
        label = f"pipe {pipe} grid {sizes} {schedule} v{virtual} {checkpointing} {sorted(overlaps)}"
        label += "".join(f" {k}" for k in options or {})
        for step, batch in enumerate(batches()):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, LR, LR / 10, 2, STEPS)
            loss, norm = map(float, pipeline_train_step(pipeline, opt, batch, CLIP))
            ref_loss, ref_norm = ref_curves[0][step], ref_curves[1][step]
            assert abs(loss - ref_loss) <= 1e-5 * ref_loss, f"{label} step {step}: {loss}"
            assert abs(norm - ref_norm) <= 1e-4 * ref_norm, f"{label} step {step}: norm {norm}"
        worst = 0.0
        for name, p in pipeline.parts.named_parameters():
            expected = p.placement.shard_of(ref_weights[name], grid)
            worst = max(worst, (p.detach() - expected).abs().max().item())
        assert worst <= 0.05 * LR, f"{label}: weights differ by {worst / LR:.3g} lr"
        if any(grid.coord.values()):
            continue
        print(f"{label}: worst weight difference {worst / LR:.2e} lr")


ALL, NONE = tuple(OVERLAPS), ()
CASES = {
    2: [
        (2, (1, 1, 1, 1, 1), "gpipe", 1, "none", ALL),
        (2, (1, 1, 1, 1, 1), "1f1b", 1, "none", ALL),
        (2, (1, 1, 1, 1, 1), "interleaved-1f1b", 2, "selective", ALL),
    ],
    4: [
        (4, (1, 1, 1, 1, 1), "1f1b", 1, "none", ALL),
        (2, (2, 1, 1, 1, 1), "1f1b", 1, "full", ALL),
        (2, (1, 1, 2, 1, 1), "1f1b", 1, "none", ALL),
        (2, (1, 1, 2, 1, 1), "interleaved-1f1b", 2, "selective", NONE),
        (2, (1, 1, 1, 2, 1), "gpipe", 1, "selective", ALL),
        (2, (1, 1, 1, 1, 2), "1f1b", 1, "none", NONE),
        (2, (1, 2, 1, 1, 1), "1f1b", 1, "none", ALL),
    ],
    8: [
        (2, (1, 1, 2, 2, 1), "1f1b", 1, "selective", ALL),
        (2, (2, 1, 1, 1, 2), "interleaved-1f1b", 2, "none", ALL),
        (4, (1, 1, 2, 1, 1), "gpipe", 1, "full", ALL),
        (2, (1, 2, 1, 2, 1), "gpipe", 1, "none", ALL),
    ],
}


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_pipeline_matches_reference(world_size, reference):
    run_distributed(pipeline_runs, world_size, world_size, *reference, CASES[world_size])


# the LM head's stage without blocks (tetrad.spec.pipeline_split): alone on its rank, beside
# another stage of the rank (interleaved), under Z (its stage gathers no block weights) and X
EMPTY_LAST = {
    2: [((2, (1, 1, 1, 1, 1), "interleaved-1f1b", 2, "selective", ALL), (1, 1, 2, 0))],
    4: [
        ((2, (1, 1, 2, 1, 1), "1f1b", 1, "none", ALL), (4, 0)),
        ((2, (1, 1, 1, 1, 2), "gpipe", 1, "full", ALL), (4, 0)),
    ],
}


@pytest.mark.parametrize("world_size", sorted(EMPTY_LAST))
def test_pipeline_with_the_head_stage_alone_matches_reference(world_size, reference):
    for case, blocks in EMPTY_LAST[world_size]:
        split = {"split": split_of_blocks(blocks, CFG.n_layers)}
        run_distributed(pipeline_runs, world_size, world_size, *reference, [case], False, split)


def test_compiled_stages_match_reference(reference):
    """``--compile`` (every block of every stage) under 1F1B with selective recompute and
    under interleaved 1F1B: the same tolerances (Dynamo's side: ``tests.test_model.AOT_EAGER``)."""
    cases = [
        (2, (1, 1, 1, 1, 2), "1f1b", 1, "selective", ALL),
        (2, (1, 1, 2, 1, 1), "interleaved-1f1b", 2, "none", ALL),
    ]
    run_distributed(pipeline_runs, 4, 4, *reference, cases, AOT_EAGER)


def pipeline_bytes_runs(world_size, cases):
    for pipe, sizes, schedule, virtual, dtype, *sp in cases:
        grid = Grid.build(sizes, pipe=pipe)
        m = BATCH // (grid.data * grid.z) // MICRO
        pipeline = Pipeline(CFG, grid, schedule, virtual, m, sequence_parallel=bool(sp))
        for part in pipeline.parts:
            init_parameters(part, SEED, grid)
        opt = build_optimizer(pipeline.parts, LR, weight_decay=0.1)
        bf16 = dtype == "bf16"
        for batch in batches()[:2]:
            grid.comm.reset()  # the first step also infers the boundary shapes
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                pipeline_train_step(pipeline, opt, batch, CLIP)
        sent = grid.comm.reset()["pipe"]
        stages = pipeline.stages
        sends = sum(not s.is_last for s in stages) + sum(not s.is_first for s in stages)
        split = grid.y if sp else 1  # sequence parallelism: [b, S/(G_context G_y), h]
        per = p2p_bytes(MICRO, SEQ, CFG.dim, grid.context, grid.x, DTYPE_BYTES[dtype], split)
        loss = 2 * (pipe - 1) / pipe * 4  # the step's fp32 loss all-reduced over the stages
        assert sent.bytes == per * m * sends + loss, f"pipe {pipe} {sizes} {schedule}"
        assert sent.calls == m * sends + 1


def test_pipeline_bytes_equal_the_planner():
    """Point-to-point bytes per step on the ``pipe`` record equal the planner's
    ``p2p_bytes`` per boundary and micro-batch, times the rank's sends (plus the loss's
    all-reduce over the stages): in fp32, and under bf16 autocast, where the residual stream
    crosses the boundaries in bf16; with sequence parallelism, split along the sequence."""
    cases = [
        (2, (1, 1, 1, 1, 2), "1f1b", 1, "fp32"),
        (2, (1, 1, 1, 2, 1), "1f1b", 1, "bf16", "sequence_parallel"),
        (2, (1, 2, 1, 1, 1), "interleaved-1f1b", 2, "fp32"),
        (2, (1, 1, 1, 1, 2), "1f1b", 1, "bf16"),
        (2, (1, 1, 2, 1, 1), "interleaved-1f1b", 2, "bf16"),
    ]
    run_distributed(pipeline_bytes_runs, 4, 4, cases)


def _counting(forward, stages, peak):
    """``forward`` that keeps in ``peak[0]`` the most forward caches ``stages`` held."""

    def run(*args, **kwargs):
        out = forward(*args, **kwargs)
        peak[0] = max(peak[0], sum(len(s.fwd_cache) for s in stages))
        return out

    return run


def in_flight_runs(world_size, cases):
    for pipe, schedule, virtual, m, micro in cases:
        grid = Grid.build((1, 1, 1, 1, 1), pipe=pipe)
        pipeline = Pipeline(CFG, grid, schedule, virtual, m)
        for part in pipeline.parts:
            init_parameters(part, SEED, grid)
        opt = build_optimizer(pipeline.parts, LR, weight_decay=0.1)
        peak = [0]
        for stage in pipeline.stages:  # the micro-batches whose activations the rank holds
            stage.forward_one_chunk = _counting(stage.forward_one_chunk, pipeline.stages, peak)
        for batch in batches()[:2]:  # the second step: the first also infers the shapes
            peak[0] = 0
            pipeline_train_step(pipeline, opt, batch[: m * micro], CLIP)
        rank = grid.coord["pipe"]
        planned = in_flight_chunks(schedule, pipe, rank, virtual, m)
        assert peak[0] == planned, f"{schedule} p={pipe} v={virtual} m={m} rank {rank}: {peak[0]}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_in_flight_micro_batches_equal_the_planner(world_size):
    """The micro-batches whose activations each rank holds at its peak (the forward caches of
    ``torch.distributed.pipelining``'s stages) equal the planner's ``in_flight_chunks``, the
    activation term of its per-stage memory: GPipe ``m v``, 1F1B ``min(m, p - r)``,
    interleaved Megatron's warm-up + 1."""
    cases = {
        2: [(2, "gpipe", 1, 4, 2), (2, "1f1b", 1, 8, 1), (2, "interleaved-1f1b", 2, 8, 1)],
        4: [(4, "1f1b", 1, 8, 1), (4, "gpipe", 1, 4, 2)],
    }
    run_distributed(in_flight_runs, world_size, world_size, cases[world_size])


def test_balanced_split_counts_embedding_and_head():
    assert balanced_split([1.0] * 8, 0.0, 0.0, 4) == ((0, 2), (2, 4), (4, 6), (6, 8))
    # a heavy head moves blocks off the last stage; uneven splits are allowed
    assert balanced_split([1.0] * 8, 1.0, 2.0, 4) == ((0, 1), (1, 4), (4, 7), (7, 8))
    # heavier still, every block: the last stage runs the head alone
    assert balanced_split([1.0] * 8, 1.0, 3.0, 4) == ((0, 2), (2, 5), (5, 8), (8, 8))
    # the runtime's default costs: no empty last stage (here both would give 2)
    assert balanced_split([1.0] * 4, 1.0, 1.0, 4) == ((0, 1), (1, 2), (2, 3), (3, 4))
    with pytest.raises(PipelineSplitError, match="at least one block"):
        balanced_split([1.0] * 3, 0.0, 0.0, 4)


def test_explicit_split_gives_the_stages_or_says_what_to_change(capsys):
    """``--pipeline-split``: blocks per stage in pipeline order -> ``(start, stop)`` ranges;
    a wrong count, a zero or a wrong sum is one line; ``tetrad train`` runs it as given and
    ``tetrad memory`` sizes it."""
    from tetrad import cli
    from tetrad.spec.pipeline_split import explicit_split
    from tetrad.train.auto import pipeline_split
    from tetrad.train.config import load_config
    from tetrad.train.sections import ConfigError

    assert explicit_split("3,5", 8, 2) == ((0, 3), (3, 8))
    assert explicit_split("4,4,0", 8, 3) == ((0, 4), (4, 8), (8, 8))  # the head's stage alone
    for bad in ("4,0,4", "4,4", "4,3,2", "a,b,c", "4,5,-1"):
        with pytest.raises(PipelineSplitError, match="give 3 block counts"):
            explicit_split(bad, 8, 3)
    over = {"model": "tiny", "grid": "pipe=2,data=1", "global_batch": 8, "micro_batch": 2}
    cfg = load_config(None, over | {"pipeline_split": "1,1"})
    cfg.check()
    assert pipeline_split(cfg, cfg.model_config()) == ((0, 1), (1, 2))
    with pytest.raises(ConfigError, match="sum to the model's 2 blocks"):
        load_config(None, over | {"pipeline_split": "1,2"}).check()
    with pytest.raises(ConfigError, match="needs a pipeline"):
        load_config(None, over | {"grid": "2,1,1,1", "pipeline_split": "1,1"}).check()
    argv = ["memory", "--model", "llama-3-70b", "--grid", "pipe=4,data=8", "--seq-len", "2048"]
    argv += ["--pipeline-schedule", "1f1b", "--pipeline-split", "17,21,21,21"]
    assert cli.main(argv) == 0
    assert "stage split as given): 0: 17 blocks" in capsys.readouterr().out


def test_schedule_checks_name_what_to_change():
    with pytest.raises(PipelineSplitError, match="choose one of gpipe, 1f1b"):
        check_schedule("zb", 2, 1, 4)
    with pytest.raises(PipelineSplitError, match="needs at least 4"):
        check_schedule("1f1b", 4, 1, 2)
    with pytest.raises(PipelineSplitError, match="2 or more virtual stages"):
        check_schedule("interleaved-1f1b", 2, 1, 4)


# ---------------------------------------------------------------- tetrad train, checkpoints


def test_train_resumes_across_stage_counts(corpus, tmp_path, monkeypatch):
    """``tetrad train`` on pipe=2 x data=2 (validation and checkpoints through the schedule),
    resumed after step 2 on 4 stages, on 2 stages x Z and with no pipeline: the uninterrupted
    run's losses (DCP keys are the whole model's parameter names)."""
    monkeypatch.setenv("TETRAD_CACHE", str(tmp_path / "cache"))
    model = {"model": "tiny,n_layers=4,vocab_size=0"}
    whole = tmp_path / "whole"
    _run(_config(corpus, whole, 4, "pipe=2,data=2", **model, val_every=2), 4)
    assert (whole / "checkpoints" / "step_0000004").is_dir()
    export(whole, tmp_path / "hf", fmt="hf")  # full weights from a pipeline run's checkpoint
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert len(list(f.keys())) == 4 * 9 + 3  # every block's 9 tensors, embedding, norm, head
    for to_grid in ("pipe=4", "pipe=2,z=2", "2,1,2,1"):
        run = tmp_path / to_grid
        _run(_config(corpus, run, 2, "pipe=2,data=2", **model), 4)
        meta = json.loads((run / "checkpoints" / "step_0000002" / "tetrad.json").read_text())
        assert meta["pipe"] == 2 and meta["grid"] == [2, 1, 1, 1, 1]
        _run(_config(corpus, run, 4, to_grid, resume=True, **model), 4)
        assert _losses(run) == pytest.approx(_losses(whole), abs=1e-5), to_grid


def test_train_with_the_head_stage_alone_resumes_on_the_default_split(
    corpus, tmp_path, monkeypatch
):
    """``tetrad train --pipeline-split 4,0`` (the LM head's stage without blocks) on pipe=2:
    the losses of the default split (2,2), and its checkpoint of step 2 resumed on the
    default split gives them too (an empty stage saves no block, the other all four)."""
    monkeypatch.setenv("TETRAD_CACHE", str(tmp_path / "cache"))
    model = {"model": "tiny,n_layers=4,vocab_size=0"}
    whole = tmp_path / "whole"
    _run(_config(corpus, whole, 4, "pipe=2", **model), 2)
    alone = tmp_path / "alone"
    _run(_config(corpus, alone, 2, "pipe=2", pipeline_split="4,0", **model), 2)
    assert (alone / "checkpoints" / "step_0000002").is_dir()
    _run(_config(corpus, alone, 4, "pipe=2", resume=True, **model), 2)
    assert len(_losses(alone)) == 4
    assert _losses(alone) == pytest.approx(_losses(whole), abs=1e-5)


def _head_slot_worker(out_dir: str) -> None:
    """pipe=2 x data=2, 1F1B and GPipe, two steps each: when the head's bucket is launched,
    the last stage's LM-head gradient is its place in the bucket (written there by the first
    micro-batch's forward, tetrad.parallel.overlap.Overlap.grad_for_forward), not a copy."""
    import torch.distributed as dist

    import tetrad.parallel.buckets as buckets

    cfg = dataclasses.replace(PRESETS["tiny"], n_layers=4)
    seen = []
    for schedule in ("1f1b", "gpipe"):
        grid = Grid.build((2, 1, 1, 1, 1), pipe=2)
        pipeline = Pipeline(cfg, grid, schedule, 1, 4)
        for part in pipeline.parts:
            init_parameters(part, 3, grid)
        opt = build_optimizer(pipeline.parts, 1e-3, weight_decay=0.1)
        head = pipeline.last.output.weight if pipeline.last is not None else None
        plain = buckets.GradBuckets._in_place

        def in_place(self, b, plain=plain, head=head):
            flat = self._flats.get(b)
            if head is not None and any(p is head for p in self._bucket):
                offset = dict((id(p), o) for p, o in self._plan[b]).get(id(head))
                placed = flat is not None and offset is not None
                seen.append(placed and head.grad.data_ptr() == flat[offset:].data_ptr())
            return plain(self, b)

        buckets.GradBuckets._in_place = in_place
        batch = torch.randint(
            0, cfg.vocab_size, (16, 17), generator=torch.Generator().manual_seed(3)
        )
        for _ in range(2):
            pipeline_train_step(pipeline, opt, batch, 1.0)
        buckets.GradBuckets._in_place = plain
    with open(f"{out_dir}/{dist.get_rank()}.json", "w") as fh:
        json.dump(seen, fh)


def test_head_gradient_is_written_in_its_bucket(tmp_path):
    """The pipeline computes its loss after the stage's forward phase; the LM head's gradient
    still lands in its data-parallel bucket (the second step of each schedule: the first lays
    the buckets out)."""
    run_distributed(_head_slot_worker, 4, str(tmp_path))
    last = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    got = [s for s in last if s]
    assert len(got) == 2, last  # the two data ranks of the last stage
    for seen in got:
        assert seen[1] and seen[3], seen  # 1F1B's and GPipe's second step
