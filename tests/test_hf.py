"""Hugging Face Llama folders: load into any grid, fine-tune, export back, against transformers.

A small random ``LlamaForCausalLM`` (GQA, untied or tied embeddings, one file or several) is
built and saved locally with transformers (a test-only dependency; no network).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from tests import hf_ranks
from tests.distributed import run_distributed
from tests.run_dirs import bpe_tokenizer
from tetrad.models.hf import load_weights, read_config
from tetrad.models.reference import Llama
from tetrad.train import trainer
from tetrad.train.config import load_config

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 384, 16  # a multiple of 128: no padding on any grid


def make_llama(
    folder: Path,
    *,
    tied: bool = False,
    shard: str | None = None,
    vocab: int = VOCAB,
    rope_scaling: dict | None = None,
) -> Path:
    """Save a random fp32 LlamaForCausalLM (4 heads, 2 KV heads) and a tokenizer in ``folder``."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,  # not the default: read from rope_parameters in transformers 5
        tie_word_embeddings=tied,
        eos_token_id=0,
        rope_scaling=rope_scaling,
    )
    model = transformers.LlamaForCausalLM(config).float()
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, max_shard_size=shard or "1GB")
    bpe_tokenizer("</s>").save(str(folder / "tokenizer.json"))
    return folder


def hf_loss(folder: Path, batch: torch.Tensor) -> tuple[torch.Tensor, float]:
    """transformers' logits of ``batch[:, :-1]`` and mean loss predicting ``batch[:, 1:]``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=batch, labels=batch)
    return out.logits[:, :-1], out.loss.item()


def tokens(n: int = 4, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("untied"))


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,  # tiny: both the scaled and the smoothed band occur
}


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["plain", "llama3-rope"])
def test_reference_logits_equal_transformers(untied, tmp_path, scaling):
    folder = untied if scaling is None else make_llama(tmp_path / "hf", rope_scaling=scaling)
    cfg = read_config(folder)[0]
    assert (cfg.rope_factor != 1.0) == (scaling is not None)
    model = Llama(cfg)
    load_weights(model, folder)
    batch = tokens()
    logits, _ = hf_loss(folder, batch)
    with torch.no_grad():
        ours = model(batch[:, :-1])
    torch.testing.assert_close(ours, logits, rtol=1e-5, atol=1e-5)


def _losses_on_grids(folder: Path, batch: torch.Tensor, tmp_path: Path, grids) -> list[float]:
    logits, _ = hf_loss(folder, batch)
    got = []
    for sizes in grids:
        out = tmp_path / f"loss_{'_'.join(map(str, sizes))}.json"
        world = sizes[0] * sizes[1] * sizes[2] * sizes[3]
        run_distributed(hf_ranks.loss_on_grid, world, folder, sizes, batch, logits, out)
        got.append(json.loads(out.read_text()))
    return got


GRIDS = [(1, 1, 1, 1), (1, 1, 2, 2), (2, 1, 2, 1), (1, 2, 2, 2)]


def test_logits_and_loss_on_every_grid_equal_transformers(untied, tmp_path):
    batch = tokens()
    _, want = hf_loss(untied, batch)
    for sizes, loss in zip(GRIDS, _losses_on_grids(untied, batch, tmp_path, GRIDS), strict=True):
        assert loss == pytest.approx(want, rel=1e-5), sizes


@pytest.mark.parametrize("tied,shard", [(True, None), (False, "40KB")], ids=["tied", "sharded"])
def test_tied_and_sharded_folders_load(tmp_path, tied, shard):
    folder = make_llama(tmp_path / "hf", tied=tied, shard=shard)
    if shard:
        assert (folder / "model.safetensors.index.json").is_file()
    batch = tokens()
    _, want = hf_loss(folder, batch)
    (loss,) = _losses_on_grids(folder, batch, tmp_path, [(1, 1, 2, 2)])
    assert loss == pytest.approx(want, rel=1e-5)


# ---------------------------------------------------------------- fine-tune and export


def _fine_tune(folder: Path, run_dir: Path, corpus: Path, grid: str, lr: float, steps: int = 3):
    cfg = load_config(
        None,
        {
            "init_from": f"hf:{folder}",
            "grid": grid,
            "steps": steps,
            "global_batch": 4,
            "micro_batch": 1,
            "seq_len": SEQ,
            "data": [str(corpus)],
            "run_dir": str(run_dir),
            "val_every": 1000,
            "val_batches": 1,
            "lr": lr,
            "min_lr": lr / 10,
            "warmup_steps": 1,
            "peak_flops": 1e9,
        },
    )
    trainer.preflight(cfg)
    world = eval(grid.replace(",", "*"))
    run_distributed(hf_ranks.train, world, cfg)
    return cfg


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "input.txt"
    path.write_text("def add(a, b):\n    return a + b\n" * 60 + "class A:\n    pass\n" * 60)
    return path


@pytest.mark.parametrize(
    "tied,vocab", [(False, VOCAB), (True, VOCAB), (False, 320)], ids=["untied", "tied", "padded"]
)
def test_fine_tune_then_export_loads_in_transformers(tmp_path, corpus, tied, vocab, monkeypatch):
    """Three steps on grid 1,1,2,2 (with vocab 320, padded to 384 there), export, then
    transformers' loss on the validation batch equals tetrad's last validation loss."""
    from tetrad.data.corpus import prepare_corpus
    from tetrad.data.loader import val_batches
    from tetrad.train.export import export

    monkeypatch.setenv("TETRAD_CACHE", str(tmp_path / "cache"))
    folder = make_llama(tmp_path / "hf", tied=tied, vocab=vocab)
    run_dir = tmp_path / "run"
    cfg = _fine_tune(folder, run_dir, corpus, "1,1,2,2", lr=1e-3)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    model_config = json.loads((run_dir / "config.json").read_text())["model_config"]
    assert model_config["vocab_size"] == 384 and model_config["unpadded_vocab"] == (vocab % 384)
    out = export(run_dir, tmp_path / "out", fmt="hf", max_shard_bytes=40_000)
    assert (out / "model.safetensors.index.json").is_file()
    d = cfg.data
    val = prepare_corpus(d.paths, d.tokenizer, d.vocab_size, d.val_fraction).val
    (batch,) = val_batches(val, 1, 4, SEQ)
    _, theirs = hf_loss(out, batch)
    assert theirs == pytest.approx(rows[-1]["val_loss"], rel=1e-5)

    from tetrad.train.generate import generate

    text = generate(str(out), "def ", 8, 0.0, 0, 0, "cpu")
    assert text.startswith("def ") and text == generate(str(run_dir), "def ", 8, 0.0, 0, 0, "cpu")


def test_round_trip_with_lr_0_is_exact(tmp_path, corpus, monkeypatch):
    from safetensors.torch import load_file

    from tetrad.train.export import export

    monkeypatch.setenv("TETRAD_CACHE", str(tmp_path / "cache"))
    folder = make_llama(tmp_path / "hf", shard="40KB")
    _fine_tune(folder, tmp_path / "run", corpus, "2,1,2,1", lr=0.0, steps=2)
    out = export(tmp_path / "run", tmp_path / "out", fmt="hf")
    before: dict = {}
    for f in folder.glob("*.safetensors"):
        before |= load_file(f)
    after = load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    for k in before:
        assert (before[k] - after[k]).abs().max().item() == 0, k
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2


# ---------------------------------------------------------------- bad input, planner


def _broken(root: Path, name: str, untied: Path) -> list[str]:
    """A damaged copy of the folder ``untied`` and the extra ``tetrad train`` arguments."""
    import shutil

    folder = root / name
    shutil.copytree(untied, folder)
    extra: list[str] = []
    if name == "no_weights":
        (folder / "model.safetensors").unlink()
    elif name == "mistral":
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(model_type="mistral", architectures=["MistralForCausalLM"])
        (folder / "config.json").write_text(json.dumps(cfg))
    elif name == "grid":
        extra = ["--grid", "1,1,3,1"]
    elif name == "big_tokenizer":
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe = trainers.BpeTrainer(
            vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
        tok.train_from_iterator([f"word{i} " * 3 for i in range(2000)], trainer=bpe)
        tok.save(str(root / "big.json"))
        extra = ["--tokenizer", str(root / "big.json")]
    return [f"hf:{folder}", *extra]


@pytest.mark.parametrize(
    "name,needle",
    [
        ("no_weights", "neither model.safetensors"),
        ("mistral", "mistral model"),
        ("grid", "G_y=3"),
        ("big_tokenizer", "vocabulary of 384"),
        ("missing", "cannot read the model config"),
    ],
)
def test_bad_hf_input_is_one_line(untied, tmp_path, corpus, name, needle):
    from tests.test_cli import assert_one_line_error, tetrad_cmd

    init, *extra = _broken(tmp_path, name, untied) if name != "missing" else ["hf:/nonexistent"]
    args = ["train", "--init-from", init, "--data", str(corpus), "--seq-len", "16"]
    args += ["--run-dir", str(tmp_path / "r")]
    r = tetrad_cmd(*args, *extra, env={"TETRAD_CACHE": str(tmp_path / "cache")})
    assert_one_line_error(r, needle)


def test_planner_reads_the_folder(untied, capsys):
    from tetrad import cli

    assert cli.main(["memory", "--model", f"hf:{untied}", "--tp", "2"]) == 0
    assert "fits" in capsys.readouterr().out
    args = ["plan", "--model", f"hf:{untied}", "--gpus", "8", "--machine", "dgx-h100"]
    assert cli.main([*args, "--global-batch", "16", "--seq-len", "64", "--top", "1"]) == 0
