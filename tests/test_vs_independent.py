"""``benchmarks/vs_independent.py`` runs (a smoke test of its one-process comparison; skipped
where the independent baseline script is not beside the checkout)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT.parent / "shared/tools/torch_baseline.py"


@pytest.mark.skipif(not BASELINE.is_file(), reason="no ../shared/tools/torch_baseline.py")
def test_one_process_comparison_runs():
    cmd = [sys.executable, str(ROOT / "benchmarks/vs_independent.py"), "one-process"]
    out = subprocess.run(cmd + ["--steps", "1"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("one process, ms")
    assert [line.split(":")[0] for line in lines[1:]] == ["baseline", "analogue", "tetrad"]


def test_unknown_row_is_one_line():
    cmd = [sys.executable, str(ROOT / "benchmarks/vs_independent.py"), "rows", "ddp9"]
    out = subprocess.run(cmd + ["--baseline", __file__], capture_output=True, text=True)
    assert out.returncode == 2 and "unknown rows ['ddp9']" in out.stderr


def test_every_row_has_the_analogue_vs_pytorch_compares_with():
    """``--analogue`` runs, for each row, a stock mode that ``benchmarks/vs_pytorch.py`` itself
    pairs with the same tetrad grid on the same world size."""
    sys.path[:0] = [str(ROOT / "benchmarks")]
    import vs_independent
    from stock_parallel import Stock
    from vs_jobs import ROWS

    assert set(vs_independent.ANALOGUES) == set(vs_independent.ROWS)
    for row, kwargs in vs_independent.ANALOGUES.items():
        world = vs_independent.ROWS[row][0]
        stock = Stock(**kwargs)
        assert stock in [s for _, s in ROWS[world]], (row, stock)


def test_the_analogue_clips_as_tetrad_does():
    """``--tetrad-args '--grad-clip 0'`` turns the analogue's clipping off too (the baseline's
    work), and a stock step with ``grad_clip = 0`` leaves the gradients as backward made them."""
    import torch

    sys.path[:0] = [str(ROOT / "benchmarks")]
    import vs_independent
    from stock_parallel import StockModel, stock_step

    assert vs_independent.grad_clip_of([]) == 1.0
    assert vs_independent.grad_clip_of(["--log-every", "1", "--grad-clip", "0"]) == 0.0
    assert vs_independent.grad_clip_of(["--grad-clip=0.5"]) == 0.5

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(4, 8, bias=False)

        def forward(self, tokens):
            return self.w(torch.nn.functional.one_hot(tokens, 4).float())

    tokens, targets = torch.tensor([[0, 1, 2]]), torch.tensor([[1, 2, 3]])
    grads = {}
    for clip in (0.0, 1e-3):
        torch.manual_seed(0)
        model = Tiny()
        run = StockModel(model, parallel_loss=False, dp_size=1, dp_rank=0, dp_group=None)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        opt.zero_grad = lambda set_to_none=True: None  # keep the gradients to compare
        stock_step(run, opt, tokens, targets, clip)
        grads[clip] = model.w.weight.grad.norm().item()
    assert grads[0.0] > 1e-3 and abs(grads[1e-3] - 1e-3) < 1e-6


def test_the_analogue_is_timed_as_the_other_sides(monkeypatch):
    """The analogue's steps are timed without a barrier before each (tetrad's trainer and the
    baseline have none), where ``benchmarks/vs_pytorch.py`` keeps its barrier."""
    sys.path[:0] = [str(ROOT / "benchmarks")]
    import vs_independent
    import vs_pytorch

    barriers = []
    monkeypatch.setattr(vs_pytorch.dist, "barrier", lambda: barriers.append(1))
    monkeypatch.setattr(vs_pytorch.dist, "all_reduce", lambda t, op=None: None)
    assert len(vs_pytorch.measure(lambda: 0.0, 3, barrier=False)["times"]) == 3 and not barriers
    vs_pytorch.measure(lambda: 0.0, 3)
    assert len(barriers) == 3

    jobs = []
    monkeypatch.setattr(vs_pytorch, "spawn", lambda job: jobs.append(job) or {"times": [1.0] * 5})
    assert vs_independent.analogue_run("pp2", 2) == 1.0
    assert jobs[0].settings.step_barrier is False and jobs[0].settings.steps == 5
