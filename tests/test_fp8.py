"""FP8 GEMMs (``--fp8``, tetrad/parallel/fp8.py) against torchao's own ``Float8Linear`` in a
single-process reference, in torchao's emulation on the CPU.

The reference is the plain Llama with its block Linears converted by
``torchao.float8.convert_to_float8_training`` (the same recipe, emulated), trained on the same
global batches with the same micro-batches (the samples cast together are the same; a scale
depends on what is cast together).

``tensorwise``: the weights' amax is all-reduced over Z, Y and X and the activations' over the
tensor axis that splits their features and over context, so on every grid each operand is cast
with the reference's scale and the FP8 values are the reference's: only the order of the sums
differs, and the first step's loss (:data:`EXACT_STEPS`) agrees to 1e-5 (relative) as the
fp32 grids of ``tests/test_model.py`` do, where FP8 itself moves it by 3e-5
(:func:`test_fp8_changes_the_reference`). Planted errors fail it: the weights' amax not
all-reduced over their output axis (the loss 2.0e-4 off at the first step on ``y2``, 6.8e-5 on
``x2``), the activations' not over context (3.3e-4 off). Later steps are held to the
:data:`NOISE` bound: another order of a sum can put an element on the other side of an FP8
rounding boundary, and the updates compound that one value's change (seen with other data
seeds: on X 1.4e-4 at the second step, where FP8 itself moves the loss by 4.1e-4, and on one
rank 7e-5 at the third, against 2.3e-4).

``rowwise``: every scale is this rank's piece's (the planner charges no all-reduce for it), so
the casts equal the reference's where a rank holds whole rows and columns (one rank, data, Z);
on Y and X a transposed Linear's rows are split, each piece scaled by its own amax, which may
round an element to a neighbouring FP8 value: the bound there is :data:`NOISE` times what FP8
does to this loss (measured: 2.4e-7 at most, as on one rank: rowwise rounds its scales down to
powers of 2, so a piece's smaller amax mostly gives the row's scale).
"""

import math
import os

import pytest
import torch

from tests.distributed import run_distributed
from tetrad.grid import Grid
from tetrad.models.reference import Llama as Reference
from tetrad.parallel import init_parameters
from tetrad.parallel.model import ParallelLlama, compile_blocks
from tetrad.spec.precision import fp8_converts, precision
from tetrad.spec.presets import PRESETS, get_model
from tetrad.train.step import build_optimizer, lr_at, train_step

pytest.importorskip("torchao.float8")

CFG = PRESETS["tiny"]
STEPS, BATCH, SEQ, MICRO, LR, CLIP, SEED = 3, 8, 16, 2, 3e-3, 1.0, 7
NOISE = 4.0
"""Largest |tetrad - reference| of a step's loss over |reference FP8 - reference fp32| at that
step, where rowwise scales rows by pieces, and after :data:`EXACT_STEPS` (module doc)."""
EXACT_STEPS = 1
"""Steps whose losses are compared to 1e-5 where the casts are the reference's (module doc)."""
BLOCK_LINEARS = ("wqkv", "wo", "w13", "w2")
MOE = get_model("moe-tiny,aux_loss_coef=0,router_z_loss_coef=0,bias_update_rate=0")
"""An MoE model: attention's Linears (and the dense block's feed-forward) in FP8, the routed
experts and the router in the compute dtype; no balancing terms or bias updates (the
reference's loop trains on the language-model loss alone)."""


def batches():
    g = torch.Generator().manual_seed(SEED)
    return [torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def reference_losses(recipe: str, every: bool = False, cfg=CFG) -> list[float]:
    """The plain Llama's losses, its block Linears converted by torchao (``off``: none;
    ``every``: whatever their shape, see :func:`_everything_converts`)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = Reference(cfg)
    init_parameters(model, SEED)
    if recipe != "off":
        config = Float8LinearConfig.from_recipe_name(recipe)
        config = type(config)(**{**config.__dict__, "emulate": True})

        def block(mod, fqn):
            converts = every or fp8_converts(recipe, mod.out_features, mod.in_features)
            return fqn.rsplit(".", 1)[-1] in BLOCK_LINEARS and converts

        convert_to_float8_training(model, config=config, module_filter_fn=block)
    opt = build_optimizer(model, LR, weight_decay=0.1)
    losses = []
    for step, batch in enumerate(batches()):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, LR, LR / 10, 2, STEPS)
        loss = 0.0
        for mb in batch.split(MICRO):  # tetrad's micro-batches: the same samples cast together
            part = model.loss_sum(mb[:, :-1], mb[:, 1:]) / batch[:, 1:].numel()
            part.backward()
            loss += part.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    return losses


def _everything_converts() -> None:
    """Convert every block Linear, whatever its shape (the tiny model's are all below rowwise's
    auto filter), in this process: the runtime's rule and the reference's filter alike."""
    from tetrad.parallel import linear

    linear.fp8_converts = lambda recipe, n, k: recipe != "off"


def _tetrad_losses(
    sizes,
    recipe: str,
    exact: bool,
    ref,
    plain,
    every: bool = False,
    cfg=CFG,
    expert: int = 1,
    checkpointing: str = "none",
    model_options: dict | None = None,
) -> None:
    if every:
        _everything_converts()
    opts = dict(model_options or {})
    compiled = opts.pop("compiled", None)
    grid = Grid.build(sizes, expert=expert)
    model = ParallelLlama(cfg, grid, checkpointing, **opts)
    init_parameters(model, SEED, grid)
    if compiled:
        compile_blocks(model, compiled)
    opt = build_optimizer(model, LR, weight_decay=0.1, policy=precision("cpu", fp8=recipe))
    for step, batch in enumerate(batches()):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, LR, LR / 10, 2, STEPS)
        loss = float(train_step(model, opt, grid, batch, MICRO, CLIP)[0])
        gap, noise = abs(loss - ref[step]), abs(ref[step] - plain[step])
        if torch.distributed.get_rank() == 0 and os.environ.get("FP8_GAPS"):
            print(f"FP8 {sizes} {recipe} step {step}: gap {gap:.2e}, FP8 itself {noise:.2e}")
        if exact and step < EXACT_STEPS:
            assert gap <= 1e-5 * ref[step], (sizes, recipe, step, loss, ref[step], noise)
        else:
            assert gap <= NOISE * noise, (sizes, recipe, step, loss, ref[step], noise)


@pytest.fixture(scope="module")
def references():
    out = {r: reference_losses(r) for r in ("off", "tensorwise")}
    out["moe"] = {r: reference_losses(r, cfg=MOE) for r in ("off", "tensorwise")}
    return out | {"rowwise": reference_losses("rowwise", every=True)}


def test_fp8_changes_the_reference(references):
    """The emulated FP8 reference is not the fp32 one (else the noise bound is vacuous). The
    first loss has FP8 in the forward alone, its rounding averaged over every token (3e-5
    here); the updates move the later ones by more."""
    gaps = [abs(a - b) for a, b in zip(references["tensorwise"], references["off"], strict=True)]
    assert gaps[0] > 1e-5 and min(gaps[1:]) > 1e-4, gaps


TENSORWISE_GRIDS = [
    (1, 1, 1, 1),
    (2, 1, 1, 1),
    (1, 2, 1, 1),
    (1, 1, 2, 1),
    (1, 1, 1, 2),
    (1, 2, 2, 2),
    (2, 2, 2, 1),
    (1, 2, 1, 1, 1),
    (1, 2, 1, 2, 1),
]
"""One rank, data, Z, Y, X, Z x Y x X and data x Z x Y (8 ranks), context and context x Y."""


@pytest.mark.parametrize(
    "sizes", TENSORWISE_GRIDS, ids=["-".join(map(str, g)) for g in TENSORWISE_GRIDS]
)
def test_tensorwise_matches_torchao(references, sizes):
    """``--fp8 tensorwise`` on each grid kind against torchao's ``Float8Linear``: the losses to
    1e-5 (module doc)."""
    ref, plain = references["tensorwise"], references["off"]
    run_distributed(_tetrad_losses, math.prod(sizes), sizes, "tensorwise", True, ref, plain)


ROWWISE_GRIDS = [
    ((1, 1, 1, 1), True),
    ((2, 1, 1, 1), True),
    ((1, 2, 1, 1), True),
    ((1, 1, 2, 1), False),
    ((1, 1, 1, 2), False),
]


@pytest.mark.parametrize(
    ("sizes", "exact"), ROWWISE_GRIDS, ids=["-".join(map(str, g)) for g, _ in ROWWISE_GRIDS]
)
def test_rowwise_matches_torchao(references, sizes, exact):
    """``--fp8 rowwise``, every block Linear converted (the tiny model's are below its auto
    filter), against torchao's rowwise ``Float8Linear`` (module doc's tolerances)."""
    ref, plain = references["rowwise"], references["off"]
    world = math.prod(sizes)
    run_distributed(_tetrad_losses, world, sizes, "rowwise", exact, ref, plain, True)


def _pipeline_losses(pipe: int, sizes, schedule: str, virtual: int, ref) -> None:
    from tetrad.pipeline.schedule import Pipeline
    from tetrad.pipeline.step import pipeline_train_step

    grid = Grid.build(sizes, pipe=pipe)
    m = BATCH // (grid.data * grid.z) // MICRO
    pipeline = Pipeline(CFG, grid, schedule, virtual, m)
    for part in pipeline.parts:
        init_parameters(part, SEED, grid)
    policy = precision("cpu", fp8="tensorwise")
    opt = build_optimizer(pipeline.parts, LR, weight_decay=0.1, policy=policy)
    for step, batch in enumerate(batches()):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, LR, LR / 10, 2, STEPS)
        loss = float(pipeline_train_step(pipeline, opt, batch, CLIP)[0])
        assert abs(loss - ref[step]) <= 1e-5 * ref[step], (pipe, sizes, schedule, step, loss)


@pytest.mark.parametrize(
    ("pipe", "sizes", "schedule", "virtual"),
    [(2, (1, 1, 1, 1, 1), "1f1b", 1), (2, (1, 1, 2, 1, 1), "gpipe", 1)],
    ids=["pipe2-1f1b", "pipe2-z2-gpipe"],
)
def test_tensorwise_pipeline_matches_torchao(references, pipe, sizes, schedule, virtual):
    """A pipeline's stages run their blocks' Linears in FP8 with the reference's casts (the
    same micro-batches): the losses of ``--fp8 tensorwise`` to 1e-5."""
    world = pipe * math.prod(sizes)
    run_distributed(
        _pipeline_losses, world, pipe, sizes, schedule, virtual, references["tensorwise"]
    )


@pytest.mark.parametrize("sizes", [(2, 1, 1, 1), (1, 1, 2, 1)], ids=["data2-ep2", "y2-ep2"])
def test_tensorwise_expert_parallel_matches_torchao(references, sizes):
    """An MoE model on expert-parallel grids (the experts split over 2 ranks): attention's
    Linears in FP8, as the reference's, to 1e-5."""
    ref, plain = references["moe"]["tensorwise"], references["moe"]["off"]
    world = math.prod(sizes)
    run_distributed(_tetrad_losses, world, sizes, "tensorwise", True, ref, plain, False, MOE, 2)


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_tensorwise_with_recomputation_matches_torchao(references, checkpointing):
    """Blocks recomputed in backward (``full``: their Linears again, under the step's policy)
    cast as the forward did: ``z=2, y=2`` to 1e-5."""
    ref, plain = references["tensorwise"], references["off"]
    args = ("tensorwise", True, ref, plain, False, CFG, 1, checkpointing)
    run_distributed(_tetrad_losses, 4, (1, 2, 2, 1), *args)


def test_checkpoints_resume_with_or_without_fp8(corpus, tmp_path):
    """``--fp8`` changes the GEMMs, not what is stored: a run's checkpoint holds fp32 weights
    and AdamW states, and resumes with FP8 off (and back on) on another grid."""
    from tests.test_resume import _run, full_state, rows
    from tests.test_resume import config as resume_config

    run = tmp_path / "run"
    for steps, grid, fp8 in ((2, "1,2,1,2", "tensorwise"), (4, "2,1,1,1", "off")):
        world = math.prod(int(g) for g in grid.split(","))
        _run(resume_config(corpus, run, steps, grid, resume=steps > 2, fp8=fp8), world)
    _run(resume_config(corpus, run, 5, "1,1,2,1", resume=True, fp8="tensorwise"), 2)
    assert [r["step"] for r in rows(run)] == [1, 2, 3, 4, 5]
    state = full_state(run / "checkpoints" / "step_0000002")
    floats = [
        t.dtype
        for k, t in state.items()
        if k.startswith(("model.", "optim.")) and t.is_floating_point()
    ]
    assert floats and set(floats) == {torch.float32}


@pytest.mark.parametrize("regather", [False, True], ids=["kept", "regathered"])
def test_tensorwise_with_sequence_parallelism_matches_torchao(references, regather):
    """Sequence parallelism (the residual stream split over Y; a pair's first Linear casts its
    gathered input, with ``regather`` gathered again for the weight gradient) on ``data=2,
    y=2``: the losses of ``--fp8 tensorwise`` to 1e-5."""
    ref, plain = references["tensorwise"], references["off"]
    opts = {"sequence_parallel": True, "sequence_parallel_regather": regather}
    args = ("tensorwise", True, ref, plain, False, CFG, 1, "none", opts)
    run_distributed(_tetrad_losses, 4, (2, 1, 2, 1), *args)


def test_fp8_benchmark_on_cpu(tmp_path):
    """``benchmarks/fp8.py`` (issue 49's GPU comparison) runs on the CPU (tiny, emulated; bf16
    and tensorwise: rowwise converts none of the tiny model's Linears), each training at a
    positive rate, with the planner's ratio where it has a machine."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "fp8.py"
    cmd = [sys.executable, str(script), "--device", "cpu", "--model", "tiny", "--steps", "4"]
    cmd += ["--recipes", "off,tensorwise", "--machine", "dgx-h100", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads((tmp_path / "fp8.json").read_text())
    assert set(got) == {"off", "tensorwise"}
    assert all(v["tokens_per_s"] > 0 for v in got.values())
    assert got["off"]["predicted_ratio"] is None and got["tensorwise"]["predicted_ratio"] > 0
    assert "| tensorwise |" in (tmp_path / "fp8.md").read_text()


def test_tensorwise_compiled_blocks_match_torchao(references):
    """``--compile`` (each block compiled, ``aot_eager`` here; the Linears and their FP8 casts
    stay eager between the graphs) on ``z=2, y=2``: the losses of ``--fp8 tensorwise`` to
    1e-5."""
    ref, plain = references["tensorwise"], references["off"]
    args = ("tensorwise", True, ref, plain, False, CFG, 1, "none", {"compiled": "aot_eager"})
    run_distributed(_tetrad_losses, 4, (1, 2, 2, 1), *args)
