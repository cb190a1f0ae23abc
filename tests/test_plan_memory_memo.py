"""The memoised memory model answers exactly what the unmemoised one does: the search's
:func:`phase_totals` equals :func:`runtime_memory`'s phases bit for bit, the grid's buffers taken
from ``(1, G_z, G_y, G_x)`` and from the unsharded grid equal those computed on the grid itself, and
bad inputs raise on every call (errors are not memoised)."""

import itertools

import pytest

from tetrad.plan.errors import PlanError
from tetrad.plan.memory import sharded_optimizer
from tetrad.plan.memory.buffers import embedding_grad_bytes, end_of_backward_bytes
from tetrad.plan.memory.grid_buffers import _unsharded, grid_buffers
from tetrad.plan.memory.runtime import PHASES, phase_totals, runtime_memory, sharding_offsets
from tetrad.plan.memory.states import tetrad_optimizer_bytes
from tetrad.spec.activation_checkpointing import CheckpointingError
from tetrad.spec.grid import GridError
from tetrad.spec.presets import PRESETS

CASES = [  # model, grid (four or five sizes)
    ("llama-3-8b", (2, 2, 2, 2)),
    ("llama-3-8b", (2, 2, 2, 2, 2)),
    ("llama-3-8b", (1, 1, 1, 1)),
    ("llama-3-8b", (3, 1, 4, 1, 2)),
    ("gpt-5b", (4, 2, 1, 2, 4)),
    ("gpt-5b", (1, 4, 2, 2, 1)),
]
MODES = ("none", "selective", "selective:3", "full", True)


@pytest.mark.parametrize("name,grid", CASES)
def test_phase_totals_equal_tetrads_phases_bit_for_bit(name, grid):
    model = PRESETS[name]
    options = itertools.product((1, 2, 5), MODES, ("bf16", "fp32"), (False, True), (False, True))
    for b, mode, dtype, prefetch, shard in options:
        kw = {"activation_checkpointing": mode, "dtype": dtype, "prefetch": prefetch}
        kw |= {"shard_optimizer": shard, "dp_overlap": not prefetch}
        got = phase_totals(model, grid, b, 1024, **kw)
        want = runtime_memory(model, list(grid), b, 1024, 80e9, **kw).phases
        assert list(got) == list(PHASES)
        assert repr(got) == repr(want), (b, mode, dtype, prefetch, shard)


@pytest.mark.parametrize("name,grid", CASES)
def test_grid_buffers_from_the_shard_grid_and_the_unsharded_one(name, grid):
    model = PRESETS[name]
    for dtype, prefetch, overlap in itertools.product(
        ("bf16", "fp32"), (False, True), (False, True)
    ):
        args = (dtype, prefetch, overlap, overlap)
        got = grid_buffers(model, grid, *args, False)
        assert repr(got) == repr(_unsharded(model, grid, *args))  # computed on the grid itself
        sharded = grid_buffers(model, grid, *args, True)
        if sharded_optimizer.data_group(grid) == 1:
            assert sharded == got
            continue
        states = tetrad_optimizer_bytes(model, grid) * sharded_optimizer.state_share(grid, True)
        assert sharded.static == (*got.static[:2], ("optimizer_states", states))
        assert sharded.base == sum(v for _, v in sharded.static)
        end = embedding_grad_bytes(model, grid) + sharded_optimizer.end_of_backward_bytes(
            model, grid
        )
        assert sharded.end_of_backward == end + got.end_prefetch
        assert sharded.step == sharded_optimizer.step_bytes(model, grid, overlap)
        assert got.end_of_backward == end_of_backward_bytes(model, grid, overlap) + got.end_prefetch
        offsets = sharding_offsets(model, grid, dtype, prefetch)
        plain = phase_totals(model, grid, 2, 1024, dtype=dtype, prefetch=prefetch)
        both = phase_totals(
            model, grid, 2, 1024, dtype=dtype, prefetch=prefetch, shard_optimizer=True
        )
        for phase in PHASES:  # the offsets move each phase to the sharded total (up to rounding)
            assert plain[phase] + offsets[phase] == pytest.approx(both[phase], rel=1e-12)


@pytest.mark.parametrize(
    "args,kw,error",
    [
        ((0, 1024), {}, PlanError),  # micro-batch
        ((1, 1024), {"dtype": "fp8"}, PlanError),
        ((1, 1024), {"activation_checkpointing": "sometimes"}, CheckpointingError),
        ((1, 1024), {"activation_checkpointing": "selective:99"}, CheckpointingError),
    ],
)
def test_errors_are_raised_on_every_call(args, kw, error):
    model = PRESETS["llama-3-8b"]
    for _ in range(2):
        with pytest.raises(error):
            phase_totals(model, (2, 2, 2, 2), *args, **kw)
    for _ in range(2):
        with pytest.raises(GridError, match="does not shard"):
            phase_totals(model, (1, 1, 3, 1), 1, 1024)
