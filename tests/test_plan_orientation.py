"""The orientation of the layer pairs: the closed-form X/Y bytes against the planner's
collective-by-collective listing, and the choice it makes."""

import itertools

import pytest

from tetrad.plan.comm.listing import axis_totals
from tetrad.plan.comm.orientation import tensor_bytes
from tetrad.plan.machine.description import get_machine
from tetrad.plan.question import StepQuestion
from tetrad.plan.step_time import best_orientation, collectives, estimate, make_step
from tetrad.spec.presets import get_model

MACHINE = get_machine("dgx-h100")
MODELS = ["llama-3-8b", "gpt-20b", "dim=64,n_layers=2,n_heads=4,n_kv_heads=2,ffn_dim=128,vocab=256"]
GRIDS = [
    (1, 1, 1, 2),
    (1, 1, 2, 1),
    (1, 2, 1, 4),
    (2, 1, 2, 2),
    (1, 1, 4, 2),
    (1, 1, 2, 4),
    (1, 2, 1, 1, 2),
    (2, 2, 2, 2, 2),
]


@pytest.mark.parametrize("model", MODELS)
def test_closed_form_bytes_equal_the_listing(model):
    """:func:`tensor_bytes` = the X and Y ring bytes of every listed collective, for each
    grid, orientation, checkpointing mode and micro-batch count, overlaps on and off."""
    spec = get_model(model)
    settings = itertools.product(GRIDS, ("xy", "yx"), ("none", "full"), (1, 2), ("all", "none"))
    for grid, orientation, ckpt, acc, overlaps in settings:
        cells = grid[0] * grid[-3]
        ctx = StepQuestion(spec, MACHINE, 256, cells * acc, overlaps=overlaps, compute_bytes=2)
        st = make_step(ctx, grid, 1, ckpt, orientation)
        cols = collectives(
            spec,
            MACHINE,
            grid,
            1,
            256,
            cells * acc,
            activation_checkpointing=ckpt,
            overlaps=overlaps,
            orientation=orientation,
        )
        totals = axis_totals(cols)
        listed = sum(totals.get(a, {}).get("bytes", 0.0) for a in ("x", "y"))
        assert tensor_bytes(st) == pytest.approx(listed, rel=1e-12), (grid, orientation, ckpt)


def test_one_tensor_axis_takes_the_y_role_whatever_its_name():
    """With X alone the pairs turn (``yx``) and then move exactly the bytes of Y alone, per
    axis renamed; with Y alone they stay."""
    spec = get_model("llama-3-8b")
    ctx = StepQuestion(spec, MACHINE, 2048, 8)
    assert best_orientation(ctx, (1, 1, 1, 4), 1, "none") == "yx"
    assert best_orientation(ctx, (1, 1, 4, 1), 1, "none") == "xy"
    assert best_orientation(ctx, (1, 2, 1, 2), 1, "none") == "yx"
    assert best_orientation(ctx, (1, 1, 1, 1), 1, "none") == "xy"
    x_only = axis_totals(collectives(spec, MACHINE, (1, 1, 1, 4), 1, 2048, 8, orientation="yx"))
    y_only = axis_totals(collectives(spec, MACHINE, (1, 1, 4, 1), 1, 2048, 8))
    assert x_only["x"]["bytes"] == y_only["y"]["bytes"] and "y" not in x_only


def test_auto_is_the_cheaper_and_named_by_the_grid():
    """``orientation="auto"`` picks :func:`best_orientation` and reports it; the per-axis
    seconds name the ``--grid``'s dimensions (X alone: only ``x``)."""
    spec = get_model("llama-3-8b")
    ctx = StepQuestion(spec, MACHINE, 2048, 8)
    est = estimate(ctx, (1, 1, 1, 8), 1, "none", orientation="auto")
    assert est.orientation == "yx" and est.comm_s["y"] == 0.0 and est.comm_s["x"] > 0.0
    xy = estimate(ctx, (1, 1, 1, 8), 1, "none", orientation="xy")
    assert est.step_s < xy.step_s
