"""The planner's answers equal the snapshot (tests/plan_snapshot.py: 2,016 step and memory
estimates, 146 ranked top-K lists, the T3 sublayer tables): same top-K order, seconds to 1e-9
relative, bytes exact. Taken before the search was made fast (a93b209) and taken again when the
search started ranking both orientations of the layer pairs: then every estimate and every row
in the ``xy`` orientation stayed the same, and 9 ``yx`` rows entered 6 of the 146 top-K lists
where they are faster. Taken again when the searches' top-K started breaking ties in step time
by enumeration order whatever order configurations are timed in (tetrad/plan/search/top.py):
one top-5 list of 144 changed, its fifth row, where the ``xy`` and ``yx`` orientations of one
grid take the same seconds to the bit, to the ``xy`` one (enumerated first)."""

import math

import pytest

from tests import plan_snapshot

REL = 1e-9


def _diffs(new, old, path: str, out: list[str], exact: bool = False) -> None:
    """Append to ``out`` every place where ``new`` differs from ``old``: ints, strings and
    everything under a memory key exactly, other floats to :data:`REL`."""
    exact = exact or "memory" in path
    if isinstance(old, dict):
        if not isinstance(new, dict) or set(new) != set(old):
            out.append(
                f"{path}: keys {sorted(new) if isinstance(new, dict) else new} != {sorted(old)}"
            )
            return
        for k in old:
            _diffs(new[k], old[k], f"{path}.{k}", out, exact)
    elif isinstance(old, list):
        if not isinstance(new, list) or len(new) != len(old):
            out.append(f"{path}: {new!r} != {old!r}")
            return
        for i, (a, b) in enumerate(zip(new, old, strict=True)):
            _diffs(a, b, f"{path}[{i}]", out, exact)
    elif isinstance(old, float) and not exact:
        if not isinstance(new, (int, float)) or not math.isclose(new, old, rel_tol=REL, abs_tol=0):
            out.append(f"{path}: {new!r} != {old!r}")
    elif new != old or type(new) is not type(old):
        out.append(f"{path}: {new!r} != {old!r}")


@pytest.fixture(scope="module")
def answers():
    return plan_snapshot.compute(), plan_snapshot.load()


@pytest.mark.parametrize("part", ["configs", "plans", "large", "sublayers", "pipeline"])
def test_planner_answers_equal_the_snapshot(answers, part):
    new, old = answers
    assert len(old["configs"]) >= 1000
    out: list[str] = []
    for i, (a, b) in enumerate(zip(new[part], old[part], strict=True)):
        where = f"{part}[{i}] ({b.get('model')} {b.get('machine')} {b.get('gpus', '')})"
        _diffs(a, b, where, out)
    assert not out, f"{len(out)} differences, first: " + "\n".join(out[:20])
