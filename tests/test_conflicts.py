"""Settings that disagree (tetrad/spec/conflicts.py), each refused in one line naming both, the
same way by ``tetrad train``, ``tetrad memory`` and ``tetrad plan``: the commands run
in-process, and ``train`` is stopped before its preflight (no data is read, no rank started)."""

from __future__ import annotations

import json
import sys
import types

import pytest

from tests.test_user_errors import one_line_error
from tetrad import cli
from tetrad.spec.conflicts import RULES, ConflictError, Settings, check_conflicts

PIPE_OPTS = ["--pipeline-schedule", "interleaved-1f1b", "--virtual-stages", "4"]
ONE = ["--grid", "1,1,1,1"]

# (name, {command: its arguments}, words every command's line holds)
CASES = [
    (
        "pipeline options without a pipeline",
        {
            "train": [*ONE, *PIPE_OPTS],
            "memory": ["--model", "llama-1b", *ONE, *PIPE_OPTS],
        },
        ["--pipeline-schedule interleaved-1f1b", "--virtual-stages 4", "pipe=1", "pipe=N"],
    ),
    (
        "pipeline options with --grid auto",
        {"train": ["--grid", "auto", "--pipeline-schedule", "gpipe"]},
        ["--pipeline-schedule gpipe", "--grid auto", "pipe=N"],
    ),
    (
        "micro-batch count without a pipeline",
        {"memory": ["--model", "llama-1b", *ONE, "--num-microbatches", "8"]},
        ["--num-microbatches 8", "pipe=1"],
    ),
    (
        "expert=N in the grid and another --expert-parallel",
        {"train": ["--model", "moe-tiny", "--grid", "data=2,expert=2", "--expert-parallel", "1"]},
        ["expert=2", "--expert-parallel is 1", "keep one"],
    ),
    (
        "MoE sizes with n_experts=0",
        {
            "train": ["--model", "tiny,n_experts=0,top_k=2", *ONE],
            "memory": ["--model", "tiny,n_experts=0,top_k=2,vocab_size=256", *ONE],
            "plan": [
                "--model",
                "tiny,n_experts=0,top_k=2,vocab_size=256",
                "--machine",
                "dgx-h100",
                "--gpus",
                "8",
                "--global-batch",
                "8",
            ],
        },
        ["top_k=2", "n_experts=0", "drop top_k"],
    ),
    (
        "fine pieces without the fine overlap",
        {"train": ["--grid", "1,1,1,2", "--overlap", "prefetch", "--fine-chunks", "4"]},
        ["--fine-chunks 4", "fine"],
    ),
    (
        "context pieces without a context axis",
        {"train": ["--grid", "1,1,1,2", "--context-pieces", "4"]},
        ["--context-pieces 4", "G_context=1"],
    ),
    (
        "context pieces without the context overlap",
        {"train": ["--grid", "1,2,1,1,1", "--overlap", "none", "--context-pieces", "4"]},
        ["--context-pieces 4", "context"],
    ),
    (
        "--nproc with a grid of another size",
        {"train": ["--grid", "1,1,1,2", "--nproc", "8"]},
        ["--nproc 8", "2 ranks"],
    ),
    (
        "regather without sequence parallelism",
        {
            "train": ["--grid", "1,1,2,1", "--sequence-parallel-regather"],
            "memory": ["--model", "llama-1b", "--grid", "1,1,2,1", "--sequence-parallel-regather"],
            "plan": ["--model", "llama-1b", "--machine", "dgx-h100", "--gpus", "8"]
            + ["--global-batch", "8", "--sequence-parallel-regather"],
        },
        ["--sequence-parallel-regather", "--sequence-parallel is off"],
    ),
    (
        "fujii2024 does not model the sharded optimizer",
        {"memory": ["--model", "llama-3-8b", "--tp", "2", "--dp", "4", "--shard-optimizer"]},
        ["--shard-optimizer", "fujii2024", "--grid"],
    ),
    (
        "fujii2024 sizes with a grid",
        {"memory": ["--model", "llama-1b", "--grid", "1,1,1,2", "--tp", "2"]},
        ["--tp 2", "--grid"],
    ),
    (
        "ranking options with --sublayers",
        {
            "plan": [
                "--model",
                "llama-1b",
                "--machine",
                "dgx-h100",
                "--sublayers",
                "2",
                "--gpus",
                "8",
            ]
        },
        ["--gpus 8", "--sublayers"],
    ),
    (
        "the residual stream's format with --sublayers",
        {
            "plan": ["--model", "llama-1b", "--machine", "dgx-h100", "--sublayers", "2"]
            + ["--residual-dtype", "fp32"]
        },
        ["--residual-dtype fp32", "--sublayers"],
    ),
]


@pytest.fixture
def no_training(monkeypatch):
    """``tetrad train`` stopped at its preflight: a case that reaches it fails."""

    def reached(cfg):
        raise AssertionError("the conflict was not refused before the preflight")

    stub = types.ModuleType("tetrad.train.trainer")
    stub.preflight = stub.train = reached
    monkeypatch.setitem(sys.modules, "tetrad.train.trainer", stub)
    for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)


RUNS = [(name, cmd, args, needles) for name, cmds, needles in CASES for cmd, args in cmds.items()]


@pytest.mark.parametrize("name,command,args,needles", RUNS, ids=[f"{r[1]}: {r[0]}" for r in RUNS])
def test_conflict_is_one_line(no_training, capsys, name, command, args, needles):
    one_line_error(capsys, [command, *args], *needles)


def test_expert_conflict_in_a_config_file(no_training, tmp_path, capsys):
    """In one file both settings disagree; a command-line option overriding the file does not
    (options win over the file, as documented)."""
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\nname = "moe-tiny"\n[parallelism]\ngrid = "data=2,expert=2"\n')
    one_line_error(capsys, ["train", "--config", str(toml), "--steps", "0"], "steps=0")
    toml.write_text(toml.read_text() + "expert_parallel = 1\n")
    one_line_error(capsys, ["train", "--config", str(toml)], "expert=2", "--expert-parallel is 1")


def test_memory_grid_with_expert_answers_and_a_disagreement_is_one_line(capsys):
    """``tetrad memory`` takes expert=N in a named grid as ``tetrad train`` does (the expert
    axis sizes the routed experts per rank); a different ``--expert-parallel`` beside it is one
    line naming both."""
    assert cli.main(["memory", "--model", "moe-small", "--grid", "data=2,expert=2"]) == 0
    assert "expert axis 2" in capsys.readouterr().out
    assert cli.main(["memory", "--model", "moe-small", "--grid", "pipe=4,data=2,expert=2"]) == 0
    capsys.readouterr()
    args = ["memory", "--model", "moe-small", "--grid", "data=2,expert=2"]
    line = one_line_error(
        capsys, args + ["--expert-parallel", "4"], "expert=2", "--expert-parallel 4"
    )
    assert "named sizes" not in line


def test_every_rule_fires_and_the_defaults_pass():
    assert check_conflicts(Settings()) == []
    fired = set()
    for settings in (
        Settings(pipe=1, virtual_stages=2),
        Settings(grid_expert=2, expert_parallel=1),
        Settings(model=_dense(), model_keys=frozenset({"top_k"})),
        Settings("memory", "tetrad", other_mode_options=("--tp 2",)),
        Settings(nproc=8, ranks=4),
        Settings(resumed={"steps": 10}, training={"steps": 20}),
    ):
        for rule in RULES:
            if rule.check(settings):
                fired.add(rule.name)
    assert fired == {r.name for r in RULES}


def _dense():
    from tetrad.spec.presets import PRESETS

    return PRESETS["tiny"]


def test_resume_with_other_steps_warns(tmp_path, monkeypatch, capsys):
    """Another --steps on --resume changes the learning-rate schedule: one warning naming both
    (training further is a reason to resume, so it is not refused)."""
    from tetrad.train.config import load_config
    from tetrad.train.preflight import _warn_resumed_settings, resumed_settings_warnings
    from tetrad.train.resume import LOCAL_WORKER

    cfg = load_config(None, {"run_dir": str(tmp_path), "steps": 20})
    assert resumed_settings_warnings(cfg) == []  # no config.json yet
    saved = {"training": {"steps": 10, "warmup_steps": cfg.training.warmup_steps}}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    (line,) = resumed_settings_warnings(cfg)
    assert "--steps 20" in line and "had 10" in line and "schedule" in line, line
    # said once: by the launcher (or rank 0 under torchrun), not again by its workers
    for env, said in (
        ({}, True),
        ({"RANK": "1"}, False),
        ({"RANK": "0", LOCAL_WORKER: "1"}, False),
    ):
        for k in ("RANK", LOCAL_WORKER):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        _warn_resumed_settings(cfg)
        assert capsys.readouterr().err == (f"tetrad: warning: {line}\n" if said else ""), env
    saved["training"]["steps"] = 20
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert resumed_settings_warnings(cfg) == []
    with pytest.raises(ConflictError):
        check_conflicts(Settings(pipe=1, pipeline_schedule="gpipe"))
