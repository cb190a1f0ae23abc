"""``tetrad train`` with an MoE model: one rank, the load-balancing loss reported apart from the
LM loss, a checkpoint (with the routers' selection biases) and an exact resume; an unsupported
grid refused by the preflight in one line."""

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
    assert all(0 < r["aux_loss"] < 0.1 for r in rows)  # coefficient 0.01, one MoE block
    assert all(r["loss"] > 1 for r in rows)  # the LM loss alone
    run_distributed(_train, 1, config(corpus, split, 2, **opts))
    run_distributed(_train, 1, config(corpus, split, 4, resume=True, **opts))
    got_rows, got = losses(split)
    assert got == expected and [r["aux_loss"] for r in got_rows] == [r["aux_loss"] for r in rows]
    final = "checkpoints/step_0000004"
    a, b = full_state(whole / final), full_state(split / final)
    bias = "model.layers.1.feed_forward.router.bias"
    assert bias in a and a[bias].abs().sum() > 0
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    from tetrad.train.generate import generate

    text = generate(str(whole), "def ", 8, 0.8, 10, 0, "cpu")
    assert text.startswith("def ")

    from tetrad.train.export import export

    folder = export(whole, tmp_path / "exported")  # tetrad's names, the biases included
    assert generate(str(folder), "def ", 8, 0.8, 10, 0, "cpu") == text
    with pytest.raises(ModelError, match="export it as safetensors"):
        export(whole, tmp_path / "hf", fmt="hf")  # a sigmoid router with a selection bias


def test_moe_tensor_grid_sequence_refused_by_preflight(corpus, tmp_path, monkeypatch):  # noqa: F811
    """On Y and X each tensor rank routes a slice of the sequence positions: a sequence length
    that does not divide is refused in one line; one that does passes."""
    monkeypatch.setenv("TETRAD_CACHE", str(tmp_path / "cache"))
    bad = config(corpus, tmp_path / "run", 2, model=MODEL, grid="1,1,2,2", seq_len=30)
    with pytest.raises(GridError, match=r"seq_len divisible by G_context\*G_y\*G_x=4") as e:
        trainer.preflight(bad)
    assert "\n" not in str(e.value)
    trainer.preflight(config(corpus, tmp_path / "run", 2, model=MODEL, grid="1,1,2,2"))
