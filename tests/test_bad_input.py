"""Every bad input a new user tried gets one line on stderr, no traceback, a non-zero exit.

The inputs of issue 10 as a table, each run through the ``tetrad`` command in a subprocess
against one small trained run directory. (The earlier one-line errors have their own tests in
``tests/test_cli.py``, which use the same assertion.)
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.test_cli import tetrad_cmd


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Data files, a trained run directory (2 steps, a checkpoint after each) and a cache."""
    root = tmp_path_factory.mktemp("bad")
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "None"]
    text = "".join(" ".join(words[(i * 7 + j) % 10] for j in range(9)) + "\n" for i in range(600))
    (root / "input.txt").write_text(text)
    (root / "empty").mkdir()
    (root / "no_text").mkdir()
    (root / "no_text" / "weights.bin").write_bytes(bytes(range(256)) * 8)
    (root / "binary.dat").write_bytes(bytes(range(256)) * 8)
    (root / "a_file").write_text("not a folder\n")
    env = {"TETRAD_CACHE": str(root / "cache")}
    r = tetrad_cmd(*train_args(root, root / "run", "--steps", "2"), env=env)
    assert r.returncode == 0, r.stderr
    return root, env


def train_args(root: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--model",
        "tiny",
        "--grid",
        "1,1,1,1",
        "--data",
        str(root / "input.txt"),
        "--vocab-size",
        "300",
        "--global-batch",
        "4",
        "--micro-batch",
        "2",
        "--seq-len",
        "32",
        "--checkpoint-every",
        "1",
        "--run-dir",
        str(run_dir),
        *extra,
    ]


def _copy_run(root: Path, name: str) -> Path:
    run = root / name
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(root / "run", run)
    return run


def _shard(run: Path) -> Path:
    return run / "checkpoints" / "step_0000002" / "__0_0.distcp"


def _truncate(run: Path) -> None:
    with _shard(run).open("r+b") as f:
        f.truncate(100)


def _flip(run: Path) -> None:
    with _shard(run).open("r+b") as f:
        f.seek(_shard(run).stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def _point(run: Path, name: str) -> None:
    (run / "checkpoints" / "latest").write_text(name + "\n")


def _to_tmp(run: Path) -> None:
    shutil.copytree(run / "checkpoints" / "step_0000002", run / "checkpoints" / "step_0000003.tmp")
    _point(run, "step_0000003.tmp")


# (name, extra train arguments or a full command, run-directory damage, words of the message)
CASES = [
    ("negative lr", ["--lr", "-1"], None, ["lr=-1.0", "0 or more"]),
    (
        "selective on more blocks than the model has",
        ["--activation-checkpointing", "selective:3"],
        None,
        ["only 2 blocks", "selective:2"],
    ),
    ("selective:K without a count", ["--activation-checkpointing", "selective:"], None, ["K >= 1"]),
    ("seq_len beyond the corpus", ["--seq-len", "100000"], None, ["--seq-len 100000", "train"]),
    ("run dir is a file", ["--run-dir", "{root}/a_file"], None, ["a_file is a file"]),
    (
        "resume another model size",
        ["--resume", "--model", "tiny,n_layers=3"],
        "copy",
        ["n_layers=2"],
    ),
    ("resume another tokenizer", ["--resume", "--vocab-size", "280"], "copy", ["tokenizer"]),
    ("truncated shard", ["--resume"], _truncate, ["__0_0.distcp", "truncated"]),
    ("corrupt shard", ["--resume"], _flip, ["__0_0.distcp", "corrupt", "rank 0"]),
    ("missing shard", ["--resume"], lambda run: _shard(run).unlink(), ["__0_0.distcp", "missing"]),
    ("latest names nothing", ["--resume"], lambda run: _point(run, "step_0000009"), ["0009"]),
    ("latest names a .tmp", ["--resume"], _to_tmp, ["step_0000003.tmp", "incomplete"]),
    (
        "resume with nothing",
        ["--resume", "--run-dir", "{root}/fresh"],
        None,
        ["does not exist", "drop --resume"],
    ),
    ("fresh run over a run", [], "copy", ["already holds checkpoints", "--resume"]),
    ("empty data folder", ["--data", "{root}/empty"], None, ["empty", "holds no files"]),
    ("folder without text", ["--data", "{root}/no_text"], None, ["no_text"]),
    ("binary data file", ["--data", "{root}/binary.dat"], None, ["binary.dat", "binary"]),
    ("memory: heads by TP", ["memory", "--model", "llama-3-8b", "--tp", "3"], None, ["3"]),
    ("memory: layers by PP", ["memory", "--model", "llama-3-8b", "--pp", "5"], None, ["32 layers"]),
    ("export into a used folder", ["export", "{run}", "{root}"], "copy", ["not an empty folder"]),
]


@pytest.mark.parametrize("name,args,damage,needles", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line(world, name, args, damage, needles):
    root, env = world
    run = _copy_run(root, "case") if damage else root / "case"
    if callable(damage):
        damage(run)
    args = [a.format(root=root, run=run) for a in args]
    cmd = args if args and args[0] in ("memory", "export") else train_args(root, run, *args)
    r: subprocess.CompletedProcess = tetrad_cmd(*cmd, env=env)
    assert r.returncode != 0, (name, r.stdout, r.stderr)
    assert "Traceback" not in r.stdout + r.stderr, name
    # the resumes here train to the default --steps, not the run's 2: warned apart
    warned = "tetrad: warning: --steps 300 (the run had 2)"
    lines = [line for line in r.stderr.strip("\n").split("\n") if not line.startswith(warned)]
    assert len(lines) == 1 and lines[0].startswith("tetrad: error:"), (name, r.stderr)
    for n in needles:
        assert n in lines[0], (name, lines[0])
