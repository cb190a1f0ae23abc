"""Inputs of issue 50 that gave a traceback or a line naming the wrong problem: each now gives
one line ``tetrad: error: ...`` naming the input, run through the command in-process (no ranks
are started: every one is refused before a worker would be)."""

from __future__ import annotations

import pytest

from tetrad import cli


def one_line_error(capsys, args: list[str], *needles: str) -> str:
    """Run ``tetrad *args`` in-process; assert exit status 2 and one line naming ``needles``."""
    try:
        code = cli.main(args)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    lines = err.strip("\n").split("\n")
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("tetrad: error:"), err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "in.txt"
    path.write_text("def f(x):\n    return x + 1\n" * 40)
    return path


def test_prepare_out_is_a_file(tmp_path, text, capsys):
    (tmp_path / "afile").write_text("a file\n")
    args = ["prepare", str(text), "--out", str(tmp_path / "afile"), "--workers", "0"]
    one_line_error(capsys, args, "afile", "is a file")
    args = ["prepare", str(text), "--out", str(tmp_path / "afile" / "sub"), "--workers", "0"]
    one_line_error(capsys, args, "afile", "--out")


@pytest.mark.parametrize("value", ["4", "true", "2.5", '"x"', "{a = 1}"])
def test_config_grid_not_sizes(tmp_path, capsys, value):
    toml = tmp_path / "run.toml"
    toml.write_text(f"[parallelism]\ngrid = {value}\n")
    one_line_error(capsys, ["train", "--config", str(toml)], "grid", "DATA,Z,Y,X")


@pytest.mark.parametrize(
    "line,needle",
    [
        ("data = 4", "data=4"),
        ("lr = [1]", "lr=[1]"),
        ("steps = true", "steps=True"),
        ("steps = 2.5", "whole number"),
        ('data = ["a", 3]', "list of paths"),
        ("[training]\nsteps = {a = 1}", "not a list or a table"),
    ],
)
def test_config_value_of_the_wrong_kind(tmp_path, capsys, line, needle):
    toml = tmp_path / "run.toml"
    toml.write_text(line + "\n")
    one_line_error(capsys, ["train", "--config", str(toml)], needle)


@pytest.mark.parametrize(
    "args,needles",
    [
        (["train", "--grid", "-2,1,1,1"], ["'-2,1,1,1'", "positive"]),
        (["train", "--lr", "-1e-3"], ["lr=-0.001", "0 or more"]),
        (["memory", "--model", "small", "--grid", "-1,1,1,1"], ["'-1,1,1,1'"]),
    ],
)
def test_negative_value_reaches_its_check(capsys, args, needles):
    """argparse alone says "expected one argument" for ``--grid -2,1,1,1``."""
    one_line_error(capsys, args, *needles)


@pytest.mark.parametrize(
    "env,ranks,threads", [("1", 1, 1), ("3", 4, 3), (None, 1, "cpus"), ("0", 1, "cpus")]
)
def test_omp_num_threads_is_respected(monkeypatch, env, ranks, threads):
    """docs/launching.md: each CPU rank takes ``cpu_count // ranks`` threads unless
    ``OMP_NUM_THREADS`` is set (a 1-rank run with ``OMP_NUM_THREADS=1`` used every core)."""
    from tetrad.device import cpu_threads, threads_per_rank

    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    assert cpu_threads(ranks) == (threads_per_rank(ranks) if threads == "cpus" else threads)


@pytest.mark.parametrize(
    "size,others",
    [
        ("moe_every=0", ["n_experts", "dense_layers"]),
        ("dense_layers=-1", ["moe_every", "n_experts"]),
        ("route_scale=0", ["expert_ffn_dim", "shared_ffn_dim"]),
        ("bias_update_rate=-1", ["aux_loss_coef"]),
    ],
)
def test_moe_size_error_names_the_wrong_size(capsys, size, others):
    args = ["memory", "--model", f"moe-tiny,{size}", "--grid", "1,1,1,1"]
    line = one_line_error(capsys, args, size)
    assert not [o for o in others if o in line], line


def test_prepare_stopped_by_sigterm_says_so(tmp_path, text, capsys, monkeypatch):
    """SIGTERM during ``tetrad prepare`` (exit 143 and nothing said before): one line saying
    how to resume, exit status 143, the default handler back afterwards."""
    import os
    import signal
    import time

    import tetrad.data.prepare as prepare

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the handler raises in this thread first
        raise AssertionError("SIGTERM did not stop tetrad prepare")

    def unhandled(signum, frame):
        raise AssertionError("tetrad prepare left SIGTERM to its default action (exit 143)")

    monkeypatch.setattr(prepare, "prepare_sources", signalled)
    before = signal.signal(signal.SIGTERM, unhandled)
    out = tmp_path / "out"
    code = cli.main(["prepare", str(text), "--out", str(out), "--workers", "0"])
    err = capsys.readouterr().err.strip().split("\n")
    assert code == 143, err
    assert len(err) == 1 and "stopped by SIGTERM" in err[0] and "resume" in err[0], err
    assert signal.signal(signal.SIGTERM, before) is unhandled


@pytest.mark.parametrize(
    "args,needle",
    [
        (["train", "--grid", "1,2,2,1"], "world size is 8"),
        (["train", "--steps", "ten"], "--steps"),
        (["train", "--config", "/nonexistent/run.toml"], "--config"),
        (["train", "--grid", "2,1,2,2", "--virtual-stages", "2"], "--virtual-stages 2"),
    ],
    ids=["world size", "option value", "config file", "conflict"],
)
def test_under_torchrun_a_mistake_is_said_by_rank_0_alone(monkeypatch, capsys, args, needle):
    """Under torchrun every rank runs the command: a mistake in the input, the same on every
    rank, is one line from rank 0; the others exit with status 2 and say nothing."""
    import sys
    import types

    stub = types.ModuleType("tetrad.train.trainer")
    stub.train = stub.preflight = lambda cfg: pytest.fail("the mistake reached training")
    monkeypatch.setitem(sys.modules, "tetrad.train.trainer", stub)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    for rank in ("3", "0"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        if rank == "0":
            one_line_error(capsys, args, needle)
            continue
        with pytest.raises(SystemExit) as e:
            cli.main(args)
        assert e.value.code == 2 and capsys.readouterr().err == ""


def test_plan_header_names_the_columns_it_heads(capsys):
    """``tetrad plan``'s header named four sizes above the D,C,Z,Y,X column, and counted the
    pipeline search without saying why no pipeline row was shown."""
    args = ["plan", "--model", "llama-1b", "--machine", "dgx-h100", "--gpus", "8"]
    assert cli.main([*args, "--global-batch", "16", "--no-classic", "--top", "3"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "grids (" in line)
    assert "G_data x G_context x G_z x G_y x G_x" in header and "D,C,Z,Y,X" in header, header
    piped = " | " in out  # a pipeline row's grid reads "P2 1f1b | 1,1,2,1,2"
    assert piped or "no pipeline row below" in header, out


def test_under_a_launcher_without_local_rank_cuda_is_refused_in_one_line(monkeypatch, capsys):
    """A launcher of several ranks that sets RANK and WORLD_SIZE but not LOCAL_RANK and
    LOCAL_WORLD_SIZE (not torchrun) would put every rank on cuda:0: rank 0 says so in one
    line naming them; the others exit with status 2 and say nothing."""
    import sys
    import types

    stub = types.ModuleType("tetrad.train.trainer")
    stub.train = stub.preflight = lambda cfg: pytest.fail("the mistake reached training")
    monkeypatch.setitem(sys.modules, "tetrad.train.trainer", stub)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = ["train", "--grid", "8,1,1,1", "--device", "cuda", "--micro-batch", "2"]
    for rank in ("3", "0"):
        monkeypatch.setenv("RANK", rank)
        if rank == "0":
            one_line_error(capsys, args, "LOCAL_RANK and LOCAL_WORLD_SIZE not set")
            continue
        with pytest.raises(SystemExit) as e:
            cli.main(args)
        assert e.value.code == 2 and capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "args,needles",
    [
        (["train", "--stepz", "3"], ["--stepz", "did you mean --steps?", "tetrad train --help"]),
        (["memory", "--model", "tiny", "--foo"], ["--foo", "tetrad memory --help"]),
        (["train", "--grid", "data=2,zz=2"], ["unknown axis 'zz'", "did you mean 'z'?"]),
        (["train", "--lr", "2e-5"], ["min_lr=0.0003", "pass --min-lr at most 2e-05"]),
        (["train", "--activation-checkpointing", "partial"], ["'partial'", "or auto"]),
    ],
    ids=["option", "memory option", "grid axis", "min lr", "checkpointing"],
)
def test_a_new_users_mistakes_are_one_line_that_says_what_to_change(capsys, args, needles):
    """Mistakes a new user made, each one line naming the fix."""
    one_line_error(capsys, args, *needles)


def test_train_with_model_hf_and_no_init_from_is_refused(tmp_path, capsys):
    """``--model hf:FOLDER`` names sizes alone (as in ``tetrad plan``): training it would start
    from random weights and another tokenizer, silently."""
    import json

    from tetrad.models.hf import hf_config
    from tetrad.spec.presets import PRESETS

    (tmp_path / "config.json").write_text(
        json.dumps(hf_config(PRESETS["tiny"], 300, None, "float32"))
    )
    line = one_line_error(capsys, ["train", "--model", f"hf:{tmp_path}"], "--init-from hf:")
    assert f"--model {tmp_path}/config.json" in line


def test_resume_of_a_missing_run_dir_creates_nothing(tmp_path, capsys):
    missing = tmp_path / "nope"
    one_line_error(capsys, ["train", "--run-dir", str(missing), "--resume"], "does not exist")
    assert not missing.exists()


def test_plan_takes_train_and_memorys_name_for_checkpointing(capsys):
    args = ["plan", "--model", "llama-1b", "--machine", "dgx-h100", "--gpus", "8"]
    args += ["--global-batch", "16", "--no-classic", "--top", "1"]
    assert cli.main([*args, "--activation-checkpointing", "full"]) == 0
    assert "grids (" in capsys.readouterr().out


def test_expert_in_a_named_grid_may_have_spaces():
    from tetrad.train.config import load_config

    cfg = load_config(None, {"grid": "data=2, expert = 2"})
    assert cfg.parallelism.expert_parallel == 2 and cfg.parallelism.grid == (2, 1, 1, 1, 1)
