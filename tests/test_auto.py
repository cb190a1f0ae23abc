"""The planner inside tetrad train: --grid auto and the Domino decision (no processes)."""

import pytest

from tetrad.train.auto import choose_grid, domino_pays
from tetrad.train.config import ConfigError, load_config


def cfg(**over):
    base = {"model": "tiny", "grid": "auto", "global_batch": 8, "micro_batch": 2, "seq_len": 32}
    return load_config(None, base | over)


def test_grid_auto_picks_a_valid_grid_of_the_world_size(capsys):
    chosen = choose_grid(cfg(machine="dgx-h100"), 4, vocab_size=256)
    d, z, y, x = chosen.parallelism.grid
    assert d * z * y * x == 4
    chosen.check()  # the batch splits and the grid is concrete now
    assert "chose D,Z,Y,X=" in capsys.readouterr().out


def test_grid_auto_needs_a_machine_on_cpu():
    with pytest.raises(ConfigError, match="--machine"):
        choose_grid(cfg(), 4, vocab_size=256)


def test_grid_auto_says_when_nothing_fits():
    with pytest.raises(ConfigError, match="no grid of 4 ranks.*global_batch=6"):
        choose_grid(cfg(machine="dgx-h100", global_batch=6, micro_batch=4), 4, vocab_size=256)


def test_unresolved_auto_grid_is_refused():
    with pytest.raises(ConfigError, match="auto"):
        cfg().check()


def test_domino_decision_follows_the_planner():
    c = cfg(grid="1,1,1,4", machine="dgx-h100")
    assert domino_pays(c, c.model_config()) in (True, False)
    assert domino_pays(cfg(grid="1,1,1,4"), c.model_config())  # no machine: the row rule alone
