"""The ``tetrad`` command line: one-line errors, option precedence, launching, generation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

import tetrad.train
from tests import cli_fork
from tests.distributed import run_distributed
from tests.run_dirs import bpe_tokenizer, fake_run_dir, save_checkpoint, save_sharded
from tetrad import cli
from tetrad.spec.model import ModelSpec
from tetrad.train import generate as gen
from tetrad.train.config import load_config, overrides
from tetrad.train.failures import record_failure
from tetrad.train.launch import run_local

ROOT = Path(__file__).resolve().parents[1]
TINY = ModelSpec(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=300)


def _has_preflight() -> bool:
    try:
        from tetrad.train import trainer
    except ImportError:
        return False
    return hasattr(trainer, "preflight")


def tetrad_cmd(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m tetrad.cli *args``, run as a child forked from tests/cli_fork.py's server
    (which has imported torch and tetrad once); ``tetrad_subprocess`` starts a new interpreter."""
    return cli_fork.run(*args, env=env)


def tetrad_subprocess(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m tetrad.cli *args`` in a new interpreter (what a user runs)."""
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")
    }
    return subprocess.run(
        [sys.executable, "-m", "tetrad.cli", *args],
        cwd=ROOT,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("tetrad: error:"), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------- errors through the CLI


def test_help(capsys):
    r = tetrad_subprocess("--help")
    assert r.returncode == 0 and "usage: tetrad" in r.stdout and "train" in r.stdout, r.stderr
    for args, needle in ((["train", "--help"], "--grid"), (["generate", "--help"], "RUN_DIR")):
        with pytest.raises(SystemExit) as e:
            cli.main(args)
        assert e.value.code == 0 and needle in capsys.readouterr().out


def test_invalid_grid():
    assert_one_line_error(tetrad_cmd("train", "--grid", "1,2,x,1"), "'1,2,x,1'", "DATA,Z,Y,X")


@pytest.mark.parametrize(
    "args",
    [("--help",), ("train", "--grid", "1,2,x,1"), ("generate", "/nonexistent/run")],
    ids=["help", "error", "generate-error"],
)
def test_forked_command_is_the_command(args):
    """tests/cli_fork.py's forked command: the exit status, stdout and stderr of a new
    interpreter running ``python -m tetrad.cli`` (what the other tests here rely on)."""
    forked, fresh = tetrad_cmd(*args), tetrad_subprocess(*args)
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        fresh.returncode,
        fresh.stdout,
        fresh.stderr,
    )


def test_grid_does_not_match_world_size():
    r = tetrad_cmd("train", "--grid", "1,2,2,1", env={"WORLD_SIZE": "8", "RANK": "0"})
    assert_one_line_error(r, "data*z*y*x = 1*2*2*1 = 4, but world size is 8", "--grid")


def test_unknown_config_key(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("stpes = 10\n")
    assert_one_line_error(tetrad_cmd("train", "--config", str(toml)), "'stpes'", "'steps'")


def test_bad_option_value_is_one_line():
    assert_one_line_error(tetrad_cmd("train", "--steps", "ten"), "--steps", "ten")


def test_missing_config_file():
    assert_one_line_error(tetrad_cmd("train", "--config", "/nonexistent/run.toml"), "--config")


def _small_corpus(tmp_path: Path) -> Path:
    data = tmp_path / "corpus"
    data.mkdir()
    for i in range(3):
        (data / f"f{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n" * 50)
    return data


@pytest.mark.skipif(not _has_preflight(), reason="tetrad.train.trainer.preflight not written yet")
def test_model_does_not_fit_grid(tmp_path):
    data = _small_corpus(tmp_path)
    r = tetrad_cmd(
        "train",
        "--model",
        "tiny,vocab_size=0",
        "--grid",
        "1,1,3,1",
        "--data",
        str(data),
        "--run-dir",
        str(tmp_path / "run"),
        env={"TETRAD_CACHE": str(tmp_path / "c")},
    )
    assert_one_line_error(r, "G_y=3")


@pytest.mark.skipif(not _has_preflight(), reason="tetrad.train.trainer.preflight not written yet")
def test_missing_data_path(tmp_path):
    r = tetrad_cmd(
        "train",
        "--model",
        "tiny",
        "--data",
        "/nonexistent/path",
        "--run-dir",
        str(tmp_path / "run"),
        env={"TETRAD_CACHE": str(tmp_path / "c")},
    )
    assert_one_line_error(r, "/nonexistent/path", "--data")


def test_generate_without_checkpoint(tmp_path):
    with pytest.raises(gen.CheckpointError, match="does not exist"):
        gen.generate(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps({"model_config": {}}))
    bpe_tokenizer().save(str(tmp_path / "tokenizer.json"))
    assert_one_line_error(tetrad_cmd("generate", str(tmp_path)), "no checkpoint")


# ---------------------------------------------------------------- options and launching


def test_command_line_overrides_toml(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        'steps = 10\nlr = 0.1\ngrid = "1,1,1,1"\nresume = true\n'
        'data = ["a.txt"]\n[model]\nn_layers = 3\n'
    )
    args = cli.build_parser().parse_args(
        [
            "train",
            "--config",
            str(toml),
            "--steps",
            "5",
            "--grid",
            "2,1,1,2",
            "--data",
            "b.txt",
            "--data",
            "c/*.txt",
            "--activation-checkpointing",
            "full",
        ]
    )
    cfg = load_config(args.config, overrides(args))
    assert cfg.training.steps == 5 and cfg.parallelism.grid == (2, 1, 1, 1, 2)
    assert cfg.data.paths == ["b.txt", "c/*.txt"]
    assert cfg.training.lr == 0.1 and cfg.checkpoint.resume is True
    assert cfg.model.sizes == {"n_layers": 3}
    assert cfg.parallelism.activation_checkpointing == "full"
    assert cfg.training.seq_len == 256  # dataclass default: neither file nor command line set it
    plain = load_config(None, overrides(cli.build_parser().parse_args(["train"])))
    assert plain.checkpoint.resume is False
    assert plain.parallelism.activation_checkpointing == "none"


@pytest.fixture
def fake_trainer(monkeypatch):
    calls = []
    stub = types.ModuleType("tetrad.train.trainer")
    stub.preflight = lambda cfg: calls.append(("preflight", cfg))
    stub.train = lambda cfg: calls.append(("train", cfg))
    monkeypatch.setitem(sys.modules, "tetrad.train.trainer", stub)
    monkeypatch.setattr(tetrad.train, "trainer", stub, raising=False)
    monkeypatch.setattr(
        "tetrad.train.launch.run_local", lambda cfg, nproc: calls.append(("run_local", nproc))
    )
    for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    return calls


def test_plain_command_preflights_then_launches(fake_trainer):
    assert cli.main(["train", "--grid", "1,2,1,2", "--steps", "3"]) == 0
    assert [c[0] for c in fake_trainer] == ["preflight", "run_local"]
    assert fake_trainer[0][1].training.steps == 3 and fake_trainer[1][1] == 4


def test_under_torchrun_trains_directly(fake_trainer, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    assert cli.main(["train", "--grid", "2,1,1,2"]) == 0
    assert [c[0] for c in fake_trainer] == ["train"]


def _report_then_fail_on_rank_1(cfg) -> None:
    rank = os.environ["RANK"]
    print(
        f"worker {rank}/{os.environ['WORLD_SIZE']} omp={os.environ.get('OMP_NUM_THREADS')}",
        flush=True,
    )
    if rank == "0":
        Path(cfg.marker).touch()
        time.sleep(60)  # stopped by the launcher once rank 1 fails
    for _ in range(600):  # rank 1 fails only after rank 0 has printed
        if Path(cfg.marker).exists():
            break
        time.sleep(0.1)
    raise ValueError("rank one is broken\nsecond line")


def test_run_local_starts_workers_and_reports_failed_rank(tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = types.SimpleNamespace(device="cpu", marker=str(tmp_path / "rank0_ran"))
    with pytest.raises(SystemExit) as e:
        run_local(cfg, 2, entrypoint=_report_then_fail_on_rank_1)
    assert e.value.code == 1
    out, err = capfd.readouterr()
    omp = max(1, (os.cpu_count() or 1) // 2)
    assert f"worker 0/2 omp={omp}" in out and f"worker 1/2 omp={omp}" in out
    assert "OMP_NUM_THREADS" not in os.environ
    assert err.endswith("tetrad: error: rank 1 failed: ValueError: rank one is broken\n")


def test_worker_failure_is_one_line_and_a_log(tmp_path, monkeypatch, capsys):
    cfg = load_config(None, {"run_dir": str(tmp_path / "run")})
    monkeypatch.setenv("RANK", "3")
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise RuntimeError("no luck\nsecond line")
    except RuntimeError as e:
        line = record_failure(cfg, e)
    log = tmp_path / "run" / "logs" / "rank_3.log"
    assert line == f"RuntimeError: no luck (rank 3; traceback in {log})"
    assert "Traceback" in log.read_text() and "second line" in log.read_text()
    assert json.loads(error_file.read_text())["message"]["message"] == line
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------- generation


@pytest.fixture
def llama():
    """The reference Llama, initialised (:func:`tetrad.parallel.init_parameters`, seed 0)."""
    pytest.importorskip("tetrad.models.reference")
    from tetrad.models.reference import Llama
    from tetrad.parallel import init_parameters

    def build(cfg):
        model = Llama(cfg)
        init_parameters(model, 0)
        return model

    return build


def test_generate_loads_checkpoint_and_samples(tmp_path, llama):
    torch.manual_seed(0)
    model = llama(TINY)
    save_checkpoint(model, fake_run_dir(tmp_path, TINY))
    loaded, tok, _ = gen.load_model(tmp_path)
    for (n, p), (n2, q) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
        assert n == n2 and torch.equal(p, q)
    a = gen.generate(tmp_path, prompt="def add", max_new_tokens=12, seed=3)
    b = gen.generate(tmp_path, prompt="def add", max_new_tokens=12, seed=3)
    assert a == b and a.startswith("def add")
    greedy = gen.generate(tmp_path, prompt="", max_new_tokens=5, temperature=0)
    assert isinstance(greedy, str)


def test_generate_cli_prints_prompt_and_continuation(tmp_path, llama, capsys):
    torch.manual_seed(0)
    save_checkpoint(llama(TINY), fake_run_dir(tmp_path, TINY))
    assert cli.main(["generate", str(tmp_path), "--prompt", "return", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("return")


def test_generate_corrupt_checkpoint(tmp_path, llama):
    folder = fake_run_dir(tmp_path, TINY)
    save_checkpoint(llama(TINY), folder)
    for f in folder.glob("*.distcp"):
        f.unlink()
    with pytest.raises(gen.CheckpointError, match="cannot be loaded"):
        gen.generate(tmp_path, max_new_tokens=1)
    (folder / ".metadata").write_bytes(b"garbage")
    with pytest.raises(gen.CheckpointError, match="cannot be loaded"):
        gen.generate(tmp_path, max_new_tokens=1)
    (tmp_path / "checkpoints" / "latest").write_text("step_0000999")
    with pytest.raises(gen.CheckpointError, match="missing or incomplete"):
        gen.generate(tmp_path, max_new_tokens=1)


def test_generate_wrong_model_size(tmp_path, llama):
    folder = fake_run_dir(tmp_path, TINY)
    save_checkpoint(
        llama(ModelSpec(dim=64, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=300)),
        folder,
    )
    with pytest.raises(gen.CheckpointError, match="cannot be loaded"):
        gen.generate(tmp_path, max_new_tokens=1)


def test_generate_loads_checkpoint_saved_as_dtensors(tmp_path, llama):
    """Two ranks save row-sharded DTensors; one process without a process group loads them."""
    folder = fake_run_dir(tmp_path, TINY)
    params = list(llama(TINY).named_parameters())
    run_distributed(
        save_sharded, 2, str(folder), [n for n, _ in params], [tuple(p.shape) for _, p in params]
    )
    loaded, _, _ = gen.load_model(tmp_path)
    torch.manual_seed(0)
    for n, p in loaded.named_parameters():
        assert torch.equal(p, torch.randn(p.shape)), n
