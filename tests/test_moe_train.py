"""``tetrad train`` with an MoE model: one rank, the load-balancing loss reported apart from the
LM loss, the routing per block (max/mean load, the balance term over its coefficient) in
``metrics.jsonl`` and ``tetrad report``, a planted routing collapse named, a checkpoint (with the
routers' selection biases) and an exact resume; an unsupported grid refused by the preflight in
one line."""

import contextlib

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_resume import full_state
from tests.test_train import config, corpus, losses  # noqa: F401  (corpus: a fixture)
from tetrad.spec.grid import GridError
from tetrad.spec.model import ModelError
from tetrad.train import trainer

MODEL = "moe-tiny,vocab_size=0,router_score=sigmoid,bias_update_rate=0.01"


def _train(cfg):
    trainer.train(cfg)


def test_moe_train_and_resume(corpus, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("TETRAD_CACHE", str(tmp_path / "cache"))
    whole, split = tmp_path / "whole", tmp_path / "split"
    opts = dict(model=MODEL, grid="1,1,1,1")
    run_distributed(_train, 1, config(corpus, whole, 4, **opts))
    rows, expected = losses(whole)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:  # one MoE block (1), coefficient 0.01; its term at most E/k = 2
        assert r["moe_balance"].keys() == r["moe_max_load"].keys() == {"1"}
        assert 0.5 < r["moe_balance"]["1"] <= 2 and 1 <= r["moe_max_load"]["1"] <= 2
        assert r["aux_loss"] == pytest.approx(0.01 * r["moe_balance"]["1"], rel=1e-6)
    assert all(r["loss"] > 1 for r in rows)  # the LM loss alone
    run_distributed(_train, 1, config(corpus, split, 2, **opts))
    run_distributed(_train, 1, config(corpus, split, 4, resume=True, **opts))
    got_rows, got = losses(split)
    assert got == expected
    for key in ("aux_loss", "moe_balance", "moe_max_load"):
        assert [r[key] for r in got_rows] == [r[key] for r in rows], key
    final = "checkpoints/step_0000004"
    a, b = full_state(whole / final), full_state(split / final)
    bias = "model.layers.1.feed_forward.router.bias"
    assert bias in a and a[bias].abs().sum() > 0
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    from tetrad.train.report import report

    text = report(whole)
    assert "MoE routing, steps 1-4" in text and (whole / "routing.png").stat().st_size > 0

    from tetrad.train.generate import generate

    text = generate(str(whole), "def ", 8, 0.8, 10, 0, "cpu")
    assert text.startswith("def ")

    from tetrad.train.export import export

    folder = export(whole, tmp_path / "exported")  # tetrad's names, the biases included
    assert generate(str(folder), "def ", 8, 0.8, 10, 0, "cpu") == text
    with pytest.raises(ModelError, match="export it as safetensors"):
        export(whole, tmp_path / "hf", fmt="hf")  # a sigmoid router with a selection bias


def _train_collapsing(cfg, out: str) -> None:
    """``tetrad train`` with every router's logits of experts 0 and 1 raised by 8 (a planted
    routing collapse: every token picks them), its output written to ``out``."""
    from tetrad.models.moe import Router

    init = Router.__init__

    def skewed(self, spec, gate):
        init(self, spec, gate)
        skew = [8.0, 8.0] + [0.0] * (spec.n_experts - 2)  # (built on the meta device)
        gate.register_forward_hook(lambda module, args, y: y + y.new_tensor(skew))

    Router.__init__ = skewed
    with open(out, "w") as f, contextlib.redirect_stdout(f):
        trainer.train(cfg)


def test_collapsing_routing_is_named(corpus, tmp_path, monkeypatch):  # noqa: F811
    """A router that sends every token to the same two of four experts: the rows report the
    total collapse (max/mean load E/k = 2) and the run prints one warning naming the block once
    it has stayed above the threshold for WARN_STEPS steps; a healthy run prints none."""
    from tetrad.train.routing import LOAD_WARN, WARN_STEPS

    monkeypatch.setenv("TETRAD_CACHE", str(tmp_path / "cache"))
    steps = WARN_STEPS + 1
    for name, collapse in (("healthy", False), ("collapsed", True)):
        run = tmp_path / name
        opts = dict(model="moe-tiny,vocab_size=0", grid="1,1,1,1", lr=1e-3)  # 3e-3: load 1.8
        cfg = config(corpus, run, steps, **opts)
        out = str(tmp_path / f"{name}.txt")
        run_distributed(_train_collapsing if collapse else _train_output, 1, cfg, out)
        rows, _ = losses(run)
        warnings = [line for line in open(out) if "routing collapse" in line]
        if collapse:
            assert all(r["moe_max_load"]["1"] == 2.0 for r in rows)
            assert all(r["moe_expert_load"]["1"] == [2.0, 2.0, 0.0, 0.0] for r in rows)
            assert len(warnings) == 1 and "MoE block 1" in warnings[0], warnings
            assert f"for {WARN_STEPS} steps (step {WARN_STEPS}: 2.00x" in warnings[0]
            assert any("| load 2.00 (block 1) balance " in line for line in open(out))
        else:
            assert all(r["moe_max_load"]["1"] < LOAD_WARN for r in rows) and not warnings


def _train_output(cfg, out: str) -> None:
    with open(out, "w") as f, contextlib.redirect_stdout(f):
        trainer.train(cfg)


def test_moe_tensor_grid_sequence_refused_by_preflight(corpus, tmp_path, monkeypatch):  # noqa: F811
    """On Y and X each tensor rank routes a slice of the sequence positions: a sequence length
    that does not divide is refused in one line; one that does passes."""
    monkeypatch.setenv("TETRAD_CACHE", str(tmp_path / "cache"))
    bad = config(corpus, tmp_path / "run", 2, model=MODEL, grid="1,1,2,2", seq_len=30)
    with pytest.raises(GridError, match=r"seq_len divisible by G_context\*G_y\*G_x=4") as e:
        trainer.preflight(bad)
    assert "\n" not in str(e.value)
    trainer.preflight(config(corpus, tmp_path / "run", 2, model=MODEL, grid="1,1,2,2"))


def test_routing_watch_names_a_block_once_per_episode():
    """A load wavering around the threshold is named once; again only after a recovery that
    lasted WARN_STEPS steps."""
    from tetrad.spec.presets import PRESETS
    from tetrad.train.routing import RoutingWatch

    watch = RoutingWatch(PRESETS["moe-tiny"], threshold=1.5, steps=3)
    loads = [1.6, 1.7, 1.8, 1.2, 1.9, 1.9, 1.9, 1.1, 1.1, 1.1, 1.6, 1.6, 1.6]
    rows = [{"step": i + 1, "moe_max_load": {"1": v}} for i, v in enumerate(loads)]
    named = [row["step"] for row in rows if watch.update([row])]
    assert named == [3, 13]  # not at 7 (back below for one step only); at 13 after 8-10
