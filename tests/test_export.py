"""`tetrad export`: full safetensors weights from a DCP checkpoint; generation from them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from tests.distributed import run_distributed
from tests.run_dirs import fake_run_dir, save_checkpoint, save_sharded
from tetrad import cli
from tetrad.models.reference import Llama
from tetrad.parallel import init_parameters
from tetrad.spec.model import ModelSpec
from tetrad.train import generate as gen
from tetrad.train.export import ExportError, export

TINY = ModelSpec(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=300)


@pytest.fixture
def run(tmp_path) -> tuple[Path, nn.Module]:
    model = Llama(TINY)
    init_parameters(model, 0)
    save_checkpoint(model, fake_run_dir(tmp_path / "run", TINY))
    return tmp_path / "run", model


def _exported(out: Path) -> dict[str, torch.Tensor]:
    index = out / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.exists() else None
    tensors = {}
    for f in sorted(files or {"model.safetensors"}):
        with safe_open(str(out / f), framework="pt") as st:
            tensors.update({k: st.get_tensor(k) for k in st.keys()})  # noqa: SIM118
    return tensors


def _one_error_line(capsys, *needles: str) -> None:
    err = capsys.readouterr().err
    lines = err.strip("\n").split("\n")
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("tetrad: error:"), err
    for n in needles:
        assert n in lines[0], lines[0]


def test_export_one_shard(run):
    run_dir, model = run
    out = export(run_dir, run_dir.parent / "out")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert (out / "config.json").read_text() == (run_dir / "config.json").read_text()
    tensors = _exported(out)
    params = dict(model.named_parameters())
    assert sorted(tensors) == sorted(params)  # no optim.* or step
    for n, p in params.items():
        assert tensors[n].dtype == torch.float32 and torch.equal(tensors[n], p), n
    assert not (run_dir.parent / "out.tmp").exists()


def test_export_several_shards_and_index(run):
    run_dir, model = run
    params = dict(model.named_parameters())
    biggest = max(p.numel() * 4 for p in params.values())
    out = export(run_dir, run_dir.parent / "out", max_shard_bytes=biggest // 3)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(shards)
    assert n > 3 and shards[0] == f"model-00001-of-{n:05d}.safetensors"
    assert shards[-1] == f"model-{n:05d}-of-{n:05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(params)
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in params.values())
    for f in shards:  # every shard holds what the index says, within the size
        with safe_open(str(out / f), framework="pt") as st:
            keys = list(st.keys())  # noqa: SIM118
            assert keys and all(index["weight_map"][k] == f for k in keys)
            size = sum(st.get_tensor(k).numel() * 4 for k in keys)
            assert size <= biggest // 3 or len(keys) == 1
    tensors = _exported(out)
    for name, p in params.items():
        assert torch.equal(tensors[name], p), name


def test_generate_from_export_matches_run_dir(run, capsys):
    run_dir, _ = run
    one = export(run_dir, run_dir.parent / "one")
    many = export(run_dir, run_dir.parent / "many", max_shard_bytes=4096)
    kw = {"prompt": "def add", "max_new_tokens": 10, "seed": 3}
    want = gen.generate(run_dir, **kw)
    assert gen.generate(one, **kw) == want
    assert gen.generate(many, **kw) == want
    argv = ["--prompt", "def add", "--max-new-tokens", "10", "--seed", "3"]
    assert cli.main(["generate", str(many), *argv]) == 0
    assert capsys.readouterr().out == want + "\n"


def test_export_bfloat16(run):
    run_dir, model = run
    out = export(run_dir, run_dir.parent / "out", dtype="bfloat16")
    tensors = _exported(out)
    for n, p in model.named_parameters():
        assert tensors[n].dtype == torch.bfloat16 and torch.equal(tensors[n], p.bfloat16()), n
    loaded, _, _ = gen.load_model(out)
    for n, p in loaded.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, tensors[n].float()), n


def test_export_cli(run, capsys):
    run_dir, model = run
    out = run_dir.parent / "out"
    out.mkdir()  # an empty OUT is fine
    argv = ["export", str(run_dir), str(out), "--to", "safetensors", "--dtype", "float32"]
    assert cli.main([*argv, "--max-shard-mb", "1"]) == 0
    assert str(out) in capsys.readouterr().out
    assert (out / "model.safetensors").is_file()


def test_export_errors(tmp_path, capsys):
    run_dir = tmp_path / "run"
    fake_run_dir(run_dir, TINY)
    out = tmp_path / "out"
    assert cli.main(["export", str(run_dir), str(out)]) == 2
    _one_error_line(capsys, "missing or incomplete")
    (run_dir / "checkpoints" / "latest").unlink()
    assert cli.main(["export", str(run_dir), str(out)]) == 2
    _one_error_line(capsys, "no checkpoint")
    assert not out.exists()
    assert cli.main(["export", str(tmp_path / "nope"), str(out)]) == 2
    _one_error_line(capsys, "does not exist")

    save_checkpoint(Llama(TINY), fake_run_dir(run_dir, TINY))
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cli.main(["export", str(run_dir), str(out)]) == 2
    _one_error_line(capsys, "not an empty folder")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert cli.main(["export", str(run_dir), str(tmp_path / "o2"), "--max-shard-mb", "0"]) == 2
    _one_error_line(capsys, "--max-shard-mb")

    with pytest.raises(ExportError, match="format 'gguf'"):
        export(run_dir, tmp_path / "o3", fmt="gguf")
    with pytest.raises(ExportError, match="dtype 'float16'"):
        export(run_dir, tmp_path / "o3", dtype="float16")


def test_corrupt_checkpoint_leaves_no_output(run, capsys):
    run_dir, _ = run
    for f in (run_dir / "checkpoints" / "step_0000300").glob("*.distcp"):
        f.unlink()
    out = run_dir.parent / "out"
    assert cli.main(["export", str(run_dir), str(out)]) == 2
    _one_error_line(capsys, "cannot read")
    assert not out.exists() and not (run_dir.parent / "out.tmp").exists()


def test_generate_from_export_with_a_missing_tensor(run):
    run_dir, _ = run
    out = export(run_dir, run_dir.parent / "out")
    tensors = _exported(out)
    del tensors["norm.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(gen.CheckpointError, match="lacks 1 parameters .*norm.weight"):
        gen.load_model(out)
    tensors["norm.weight"] = torch.ones(5)
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(gen.CheckpointError, match="cannot be loaded"):
        gen.load_model(out)


def test_export_checkpoint_saved_as_dtensors(tmp_path):
    """Two gloo ranks save row-sharded DTensors; the export holds the full tensors."""
    run_dir = tmp_path / "run"
    folder = fake_run_dir(run_dir, TINY)
    params = list(Llama(TINY).named_parameters())
    run_distributed(
        save_sharded, 2, str(folder), [n for n, _ in params], [tuple(p.shape) for _, p in params]
    )
    tensors = _exported(export(run_dir, tmp_path / "out", max_shard_bytes=20_000))
    torch.manual_seed(0)
    for n, p in params:
        assert torch.equal(tensors[n], torch.randn(p.shape)), n


def test_cli_import_does_not_import_torch():
    code = (
        "import sys, tetrad.cli as c; c.build_parser().parse_args(['export', 'a', 'b']); "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'safetensors')]; "
        "assert not bad, bad[:5]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
