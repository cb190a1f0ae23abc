"""`tetrad plan` and `tetrad memory` through the planner's argparse wiring."""

import json
import re
import subprocess
import sys

import pytest

from tetrad import cli

PLAN = [
    "plan",
    "--model",
    "llama-3.1-8b",
    "--machine",
    "dgx-h100",
    "--gpus",
    "64",
    "--global-batch",
    "256",
    "--seq-len",
    "8192",
    "--top",
    "3",
]


def run(argv, capsys):
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_table(capsys):
    rc, out, err = run(PLAN, capsys)
    assert rc == 0 and not err
    assert "D,C,Z,Y,X" in out and "TP,CP,PP,DP" in out and "MFU" in out
    assert "memory of these (GiB)" in out and "exp z" in out


def test_plan_json(capsys):
    rc, out, _ = run(PLAN + ["--json"], capsys)
    data = json.loads(out)
    assert rc == 0 and len(data["four_d"]) == 3
    row = data["four_d"][0]
    assert row["memory"]["fits"] and row["step_s"] > row["compute_s"] > 0
    assert {"x", "y", "z", "data"} <= set(row["exposed_comm_s"])


def test_plan_checkpointing_modes(capsys):
    """auto tries none, selective and full; one mode (or on/off, aliases of full/none) only
    that one; the JSON rows carry the mode's name (selective where none does not fit: on the
    fewest blocks that fit, ``selective:K``)."""
    seen = set()
    for flag, want in (("selective", {"selective"}), ("on", {"full"}), ("off", {"none"})):
        rc, out, _ = run(PLAN + ["--json", "--top", "20", "--checkpointing", flag], capsys)
        rows = json.loads(out)["four_d"]
        modes = {r["activation_checkpointing"].partition(":")[0] for r in rows}
        assert rc == 0 and modes == want
        seen |= want
    rc, out, _ = run(PLAN + ["--checkpointing", "selective"], capsys)
    assert rc == 0 and " selective " in out
    assert seen == {"none", "selective", "full"}


def test_emit_config_loads_in_tetrad_train(tmp_path, capsys):
    from tetrad.train.config import load_config

    path = tmp_path / "best.toml"
    rc, _, err = run(
        [
            "plan",
            "--model",
            "gpt-80b",
            "--machine",
            "perlmutter",
            "--gpus",
            "1024",
            "--global-batch",
            "2048",
            "--no-classic",
            "--emit-config",
            str(path),
        ],
        capsys,
    )
    assert rc == 0 and "wrote config" in err
    cfg = load_config(str(path))
    cfg.check()
    d, c, z, y, x = cfg.parallelism.grid
    t = cfg.training
    assert cfg.parallelism.pipe * d * c * z * y * x == 1024
    assert t.global_batch == 2048 and t.seq_len == 2048
    assert cfg.parallelism.overlap == "all"
    model = cfg.model_config()
    assert (model.dim, model.n_layers, model.n_heads, model.vocab_size) == (12288, 42, 96, 51200)


def test_plot_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    rc, _, _ = run(PLAN + ["--plot", str(path)], capsys)
    assert rc == 0 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_fujii_flags_above_80_percent(capsys):
    # Fujii et al.'s own test row: 44.87 GiB model states + 22.64 GiB activations = 84% of 80
    rc, out, _ = run(
        [
            "memory",
            "--model",
            "llama-3.1-8b",
            "--tp",
            "2",
            "--dp",
            "2",
            "--micro-batch",
            "1",
            "--seq-len",
            "8192",
        ],
        capsys,
    )
    assert rc == 0 and "does NOT fit" in out and "67.52" in out
    rc, out, _ = run(
        [
            "memory",
            "--model",
            "llama-3.1-8b",
            "--tp",
            "2",
            "--dp",
            "2",
            "--seq-len",
            "8192",
            "--gpu-memory-gib",
            "94",
            "--json",
        ],
        capsys,
    )
    data = json.loads(out)
    assert data["fits"] and data["method"] == "fujii2024"
    assert data["total_gib"] == pytest.approx(44.87260437011719 + 22.64453125)


def test_memory_tetrad_grid(capsys):
    rc, out, _ = run(
        [
            "memory",
            "--model",
            "llama-1b",
            "--grid",
            "2,1,2,2",
            "--micro-batch",
            "2",
            "--seq-len",
            "2048",
            "--machine",
            "perlmutter",
        ],
        capsys,
    )
    assert rc == 0 and "tetrad runtime" in out and "% of GPU" in out
    assert ("fits:" in out) != ("does NOT fit" in out)
    totals = {}
    flags = {"none": [], "selective": ["selective"], "full": []}  # no value: full
    for mode, value in flags.items():
        option = [] if mode == "none" else ["--activation-checkpointing", *value]
        argv = ["memory", "--model", "llama-1b", "--grid", "2,1,2,2", "--json", *option]
        rc, out, _ = run(argv, capsys)
        totals[mode] = json.loads(out)["total_gib"]
    assert totals["full"] < totals["selective"] < totals["none"]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (
            [
                "plan",
                "--model",
                "gpt-80x",
                "--machine",
                "perlmutter",
                "--gpus",
                "8",
                "--global-batch",
                "8",
            ],
            "did you mean 'gpt-80b'",
        ),
        (
            [
                "plan",
                "--model",
                "gpt-80b",
                "--machine",
                "perlmuter",
                "--gpus",
                "8",
                "--global-batch",
                "8",
            ],
            "did you mean 'perlmutter'",
        ),
        (
            [
                "plan",
                "--model",
                "gpt-80b",
                "--machine",
                "perlmutter",
                "--gpus",
                "1000",
                "--global-batch",
                "2048",
            ],
            "--gpus 1024",
        ),
        (
            [
                "plan",
                "--model",
                "gpt-80b",
                "--machine",
                "perlmutter",
                "--gpus",
                "8",
                "--global-batch",
                "8",
            ],
            "more --gpus",
        ),
        (["memory", "--model", "llama-1b", "--method", "tetrad"], "needs --grid"),
        (["memory", "--model", "llama-1b", "--grid", "2,2"], "DATA,Z,Y,X"),
        (["memory", "--model", "llama-1b", "--grid", "1,3,1,1"], "does not shard"),
    ],
)
def test_bad_input_one_line_error(argv, needle, capsys):
    rc, out, err = run(argv, capsys)
    assert rc == 2 and not out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tetrad: error: ") and needle in lines[0]


def test_planner_imports_no_torch():
    code = (
        "import sys; import tetrad.plan.cli, tetrad.plan.search.plan, tetrad.plan.search.report; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'matplotlib')"
        " or m in ('tetrad.train', 'tetrad.parallel', 'tetrad.grid')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_emit_config_with_a_pipeline(tmp_path, capsys):
    """The pipeline axis is searched by default: the best gpt-80b plan on 1,024 Perlmutter GPUs
    for a global batch of 1,024 has a pipeline (at 2,048 the 256 micro-batches' receive buffers,
    12 GiB per GPU, leave it to the 5D grids): ``grid`` in the ``PIPE,DATA,CONTEXT,Z,Y,X`` form
    and the ``pipeline_schedule`` and ``virtual_stages`` keys, a file ``tetrad train`` reads."""
    from tetrad.spec.grid import parse_pipeline_grid
    from tetrad.spec.toml import tomllib

    path = tmp_path / "best.toml"
    argv = ["plan", "--model", "gpt-80b", "--machine", "perlmutter", "--gpus", "1024"]
    argv += ["--global-batch", "1024", "--emit-config", str(path)]
    rc, out, err = run(argv, capsys)
    assert rc == 0 and "wrote config" in err and "[P v sched]" in out
    par = tomllib.loads(path.read_text())["parallelism"]
    pipe, sizes = parse_pipeline_grid(par["grid"])
    assert pipe > 1 and len(par["grid"].split(",")) == 6
    assert pipe * sizes[0] * sizes[1] * sizes[2] * sizes[3] * sizes[4] == 1024
    assert par["pipeline_schedule"] in ("gpipe", "1f1b", "interleaved-1f1b")
    assert par["virtual_stages"] >= 1
    from tetrad.train.config import load_config

    cfg = load_config(str(path))  # tetrad train takes it as it is
    cfg.check()
    assert cfg.parallelism.pipe == pipe and cfg.parallelism.grid == sizes


def test_no_pipeline_leaves_the_axis_out(capsys):
    """``--no-pipeline`` ranks the 5D grids alone; ``--pipeline`` (the default) is still
    accepted, and the two together are refused."""
    argv = ["plan", "--model", "gpt-20b", "--machine", "perlmutter", "--gpus", "256"]
    argv += ["--global-batch", "512", "--no-classic"]
    rc, out, _ = run(argv + ["--no-pipeline"], capsys)
    assert rc == 0 and "[P v sched]" not in out and "G_pipe" not in out
    rc, default, _ = run(argv, capsys)
    assert rc == 0 and "pipeline (G_pipe x virtual stages x schedule on top)" in default
    rc, named, _ = run(argv + ["--pipeline"], capsys)
    strip = re.compile(r"search took [0-9.]+ s")
    assert rc == 0 and strip.sub("", named) == strip.sub("", default)
    with pytest.raises(SystemExit):
        run(argv + ["--pipeline", "--no-pipeline"], capsys)


def test_memory_on_a_pipeline_grid(capsys):
    base = ["memory", "--model", "llama-3-70b", "--seq-len", "2048"]
    rc, named, _ = run(base + ["--grid", "pipe=8,data=8,y=2,x=4"], capsys)
    assert rc == 0 and "1f1b" in named and "pipeline ranks" in named
    rc, listed, _ = run(base + ["--grid", "8,8,1,1,2,4"], capsys)
    assert rc == 0 and listed == named
    rc, out, err = run(
        base + ["--grid", "8,8,1,1,2,4", "--pipeline-schedule", "interleaved-1f1b"], capsys
    )
    assert rc != 0 and "virtual stages >= 2" in (out + err)


def test_memory_with_bf16_weights(capsys):
    """``tetrad memory --param-dtype bf16`` on the 70B layout of issue 45 (Megatron's TP 2 x CP
    4 x PP 8 x DP 8, interleaved, sharded optimizer): the parameters halve, the masters join
    the sharded states (2 + 4 + 12 / (d c) bytes), the gradients stay fp32."""
    base = ["memory", "--model", "llama-3-70b", "--seq-len", "8192", "--shard-optimizer"]
    base += ["--grid", "pipe=8,data=8,context=4,y=2", "--pipeline-schedule", "interleaved-1f1b"]
    base += ["--virtual-stages", "5", "--json"]
    got = {}
    for dtype in ("fp32", "bf16"):
        rc, out, _ = run(base + ["--param-dtype", dtype], capsys)
        assert rc == 0
        got[dtype] = json.loads(out)["components_gib"]
    fp32, bf16 = got["fp32"], got["bf16"]
    assert bf16["parameters"] == pytest.approx(fp32["parameters"] / 2)
    assert bf16["gradients"] == fp32["gradients"]
    assert bf16["optimizer_states"] == pytest.approx(fp32["optimizer_states"] * 1.5)
    assert bf16["parameters"] < 8.95 < fp32["parameters"]  # Megatron's (Fujii et al.'s) 8.95


def test_memory_with_bf16_weights_and_sequence_parallel(capsys):
    """The two compose on the 70B layout of issue 45: ``--param-dtype bf16`` moves the weights'
    terms (parameters, states, no gathered copy at G_z = 1) and ``--sequence-parallel`` the
    activations' (saved tensors and the stage boundaries' buffers split over Y), each as alone."""
    base = ["memory", "--model", "llama-3-70b", "--seq-len", "8192", "--shard-optimizer"]
    base += ["--grid", "pipe=8,data=8,context=4,y=2", "--pipeline-schedule", "interleaved-1f1b"]
    base += ["--virtual-stages", "5", "--micro-batch", "1", "--json"]
    got = {}
    for dtype in ("fp32", "bf16"):
        for sp in ([], ["--sequence-parallel"]):
            rc, out, _ = run(base + ["--param-dtype", dtype, *sp], capsys)
            assert rc == 0
            got[dtype, bool(sp)] = json.loads(out)["components_gib"]
    plain, both = got["fp32", False], got["bf16", True]
    weights, sequence = got["bf16", False], got["fp32", True]
    for k in ("parameters", "gradients", "optimizer_states", "gathered_weights"):
        assert both[k] == pytest.approx(weights[k])
    for k in ("activations", "pipeline_buffers"):
        assert both[k] == pytest.approx(sequence[k]) and sequence[k] < plain[k]
    total = {key: sum(c.values()) for key, c in got.items()}  # each saving as alone
    assert total["bf16", True] == pytest.approx(
        total["bf16", False] + total["fp32", True] - total["fp32", False]
    )


def test_memory_splits_stages_by_the_sequence_parallel_compute(capsys):
    """``tetrad memory --sequence-parallel`` on a pipeline grid splits the blocks by the
    planner's compute with it (the norms on the sequence shard), as the search and ``tetrad
    train`` do: Llama-3.1-8B, pipe 4 x Y 8, 2,048 tokens, 8/9/9/6 blocks (7/9/9/7 without)."""
    argv = ["memory", "--model", "llama-3.1-8b", "--seq-len", "2048", "--machine", "dgx-h100"]
    argv += ["--grid", "pipe=4,y=8", "--micro-batch", "1", "--num-microbatches", "8"]
    for sp, blocks in (([], (7, 9, 9, 7)), (["--sequence-parallel"], (8, 9, 9, 6))):
        rc, out, _ = run(argv + sp, capsys)
        assert rc == 0
        split = re.search(r"pipeline ranks \(stage split[^)]*\): (.*)", out).group(1)
        assert tuple(int(n) for n in re.findall(r"\d+: (\d+) blocks", split)) == blocks


def test_plan_with_bf16_weights(tmp_path, capsys):
    """``tetrad plan --param-dtype bf16``: every ranked row's memory (5D grids, and each rank
    of the pipeline grids) has 2-byte weights beside fp32 gradients, and the emitted
    configuration asks for them (``[precision] params``, which ``tetrad train`` reads)."""
    from tetrad.train.config import load_config

    path = tmp_path / "best.toml"
    argv = ["plan", "--model", "gpt-80b", "--machine", "perlmutter", "--gpus", "1024"]
    argv += ["--global-batch", "1024", "--no-classic", "--json"]
    rc, out, _ = run(argv + ["--param-dtype", "bf16", "--emit-config", str(path)], capsys)
    assert rc == 0
    rows = json.loads(out)["four_d"]
    mems = [r["memory"] for r in rows]
    mems += [m for r in rows if r["pipeline"] for m in r["pipeline"]["stage_memory"]]
    assert len(mems) > len(rows)  # pipeline rows among them
    for m in mems:
        assert m["components_bytes"]["parameters"] * 2 == m["components_bytes"]["gradients"]
    assert load_config(str(path)).policy.params == "bf16"


def test_memory_with_the_residual_stream_in_bf16(capsys):
    """``tetrad memory --residual-dtype`` on the 70B layout of issue 45 with bf16 weights and
    sequence parallelism: the default (``auto``, the compute dtype: bf16) keeps fewer
    activations and pipeline buffers than ``fp32`` (no fp32 stream, no fp32 copy of what a stage
    receives, no normalised tensor), the weights' terms the same; the option is tetrad's only."""
    base = ["memory", "--model", "llama-3-70b", "--seq-len", "8192", "--shard-optimizer"]
    base += ["--grid", "pipe=8,data=8,context=4,y=2", "--pipeline-schedule", "interleaved-1f1b"]
    base += ["--virtual-stages", "5", "--micro-batch", "1", "--json"]
    base += ["--param-dtype", "bf16", "--sequence-parallel"]
    got = {}
    for residual in ("fp32", "auto", "bf16"):
        rc, out, _ = run(base + ["--residual-dtype", residual], capsys)
        assert rc == 0
        got[residual] = json.loads(out)["components_gib"]
    fp32, bf16 = got["fp32"], got["auto"]
    assert got["bf16"] == bf16
    for k in ("parameters", "gradients", "optimizer_states"):
        assert bf16[k] == fp32[k]
    for k in ("activations", "pipeline_buffers"):
        assert bf16[k] < fp32[k]
    total = {key: sum(c.values()) for key, c in got.items()}
    # 67.83 and 58.84 before a block Linear's weight gradient lost its fp32 copy (G_z = 1);
    # 66.95 and 57.97 before CUDA's context masks became the lower-right CausalBias (no tensor);
    # 66.86 and 57.88 before the loss lost its second pass (the head weighs less in the split)
    assert total["fp32"] == pytest.approx(65.14, abs=0.01)  # the fp32 stream, before
    assert total["auto"] == pytest.approx(56.56, abs=0.01)  # Fujii et al.: 54.33
    rc, out, err = run(["memory", "--model", "llama-3-70b", "--residual-dtype", "fp32"], capsys)
    assert rc != 0 and "--residual-dtype fp32" in out + err


def _memory_of_row(row, residual, capsys, more=()) -> float:
    """``tetrad memory --method tetrad`` of a ``tetrad plan --json`` row of llama-3-70b on
    dgx-h100 at 4096 tokens (its grid, orientation, micro-batch, mode, optimizer, pipeline),
    with ``--residual-dtype residual`` and the options ``more``: the total bytes (a
    pipeline's worst rank's)."""
    sizes, pipe = row["sizes"], row.get("pipeline")
    grid = ",".join(f"{k}={sizes[k]}" for k in ("data", "context", "z", "y", "x"))
    argv = ["memory", "--model", "llama-3-70b", "--machine", "dgx-h100", "--seq-len", "4096"]
    argv += ["--micro-batch", str(row["micro_batch"]), "--orientation", row["orientation"]]
    argv += ["--activation-checkpointing", row["activation_checkpointing"], "--json"]
    argv += ["--residual-dtype", residual] + (
        ["--shard-optimizer"] if row.get("shard_optimizer") else []
    )
    if pipe:
        grid = f"pipe={pipe['pipe']}," + grid
        argv += ["--pipeline-schedule", pipe["schedule"], "--virtual-stages"]
        argv += [str(pipe["virtual_stages"]), "--num-microbatches", str(row["grad_accum"])]
    rc, out, _ = run(argv + list(more) + ["--grid", grid], capsys)
    assert rc == 0
    return json.loads(out)["total_bytes"]


def test_plan_with_an_fp32_residual_stream(capsys):
    """``tetrad plan --residual-dtype fp32`` (as ``tetrad memory``'s): every ranked row's memory,
    5D grids and pipeline grids (their worst rank), is ``tetrad memory``'s of the same
    configuration with ``--residual-dtype fp32``, and more than with the default stream (auto:
    bf16 on GPUs) on the same configuration; the inputs record the format."""
    argv = ["plan", "--model", "llama-3-70b", "--machine", "dgx-h100", "--gpus", "64"]
    argv += ["--global-batch", "128", "--seq-len", "4096", "--top", "6", "--no-classic"]
    rc, out, _ = run(argv + ["--json", "--residual-dtype", "fp32"], capsys)
    assert rc == 0
    data = json.loads(out)
    assert data["inputs"]["residual_dtype"] == "fp32"
    rows = data["four_d"]
    assert {"pipeline" in r for r in rows} == {True, False}  # both kinds among them
    for row in rows:
        fp32 = _memory_of_row(row, "fp32", capsys)
        assert row["memory"]["total_bytes"] == fp32 > _memory_of_row(row, "auto", capsys)
    rc, out, _ = run(argv + ["--residual-dtype", "fp32"], capsys)
    assert rc == 0 and "residual stream fp32" in out  # the text report says so too


def test_plan_emits_the_residual_stream_format(tmp_path, capsys):
    """``--emit-config`` of ``tetrad plan --residual-dtype fp32`` asks ``tetrad train`` for the
    same stream (``[precision] residual``); with the default (auto) it leaves the runtime's
    (bf16 on cuda)."""
    from tetrad.train.config import load_config

    argv = ["plan", "--model", "llama-1b", "--machine", "dgx-h100", "--gpus", "8"]
    argv += ["--global-batch", "64", "--seq-len", "4096", "--top", "1", "--no-classic"]
    for residual, want in (("fp32", "fp32"), ("auto", "bf16")):
        path = tmp_path / f"{residual}.toml"
        rc, _, _ = run(argv + ["--residual-dtype", residual, "--emit-config", str(path)], capsys)
        assert rc == 0
        cfg = load_config(str(path))
        assert cfg.precision.residual == residual and cfg.policy.residual == want


def test_plan_rejects_what_fits_only_with_a_bf16_stream(capsys):
    """llama-1b on one GPU at 4096 tokens, micro-batch 1, no checkpointing: 22.42 GiB with the
    default bf16 stream, 23.96 GiB with an fp32 one (22.54 and 24.09 while the LM head kept its
    ``dW`` for backward); with 29 GiB (23.2 GiB usable) ``tetrad plan`` ranks it under auto
    and finds nothing under fp32."""
    argv = ["plan", "--model", "llama-1b", "--machine", "dgx-h100", "--gpus", "1"]
    argv += ["--global-batch", "1", "--seq-len", "4096", "--checkpointing", "off"]
    argv += ["--no-classic", "--gpu-memory-gib", "29", "--json"]
    rc, out, _ = run(argv, capsys)
    assert rc == 0
    row = json.loads(out)["four_d"][0]
    assert row["memory"]["total_gib"] == pytest.approx(22.42, abs=0.01)
    rc, out, err = run(argv + ["--residual-dtype", "fp32"], capsys)
    assert rc != 0 and "fits under 80% of 29 GiB" in out + err
    assert "--residual-dtype auto" in out + err


def test_memory_with_the_first_linears_inputs_gathered_again(capsys):
    """``tetrad memory --sequence-parallel-regather`` on the 70B layout of issue 45 (bf16
    weights and stream, sequence parallelism): only the activations shrink, by the first
    Linears' gathered copies' ``(G_y - 1)/G_y`` (docs/memory.md: 27.41 -> 24.76 GiB)."""
    base = ["memory", "--model", "llama-3-70b", "--seq-len", "8192", "--shard-optimizer"]
    base += ["--grid", "pipe=8,data=8,context=4,y=2", "--pipeline-schedule", "interleaved-1f1b"]
    base += ["--virtual-stages", "5", "--micro-batch", "1", "--json"]
    base += ["--param-dtype", "bf16", "--sequence-parallel"]
    got = {}
    for extra in ([], ["--sequence-parallel-regather"]):
        rc, out, _ = run(base + extra, capsys)
        assert rc == 0
        got[bool(extra)] = json.loads(out)["components_gib"]
    kept, again = got[False], got[True]
    assert {k for k in kept if kept[k] != again[k]} == {"activations"}
    assert round(kept["activations"], 2) == 27.41 and round(again["activations"], 2) == 24.76


def test_plan_with_sequence_parallel_regather(capsys):
    """``tetrad plan --sequence-parallel on --sequence-parallel-regather``: every ranked row
    with a tensor axis has sequence parallelism and, 5D grids and pipeline grids (their worst
    rank), ``tetrad memory --sequence-parallel --sequence-parallel-regather``'s memory of the
    same configuration, less than without regather where blocks save their activations (not
    ``full``); the inputs and the text report say so."""
    argv = ["plan", "--model", "llama-3-70b", "--machine", "dgx-h100", "--gpus", "64"]
    argv += ["--global-batch", "128", "--seq-len", "4096", "--top", "2", "--no-classic"]
    argv += ["--sequence-parallel", "on", "--sequence-parallel-regather"]
    rows = []
    for more in ([], ["--no-pipeline"]):
        rc, out, _ = run(argv + more + ["--json"], capsys)
        assert rc == 0
        data = json.loads(out)
        assert data["inputs"]["sequence_parallel_regather"] is True
        rows += data["four_d"]
    assert {"pipeline" in r for r in rows} == {True, False}  # both kinds among them
    sp = ["--sequence-parallel"]
    for row in rows:
        if "sequence_parallel" not in row:  # no tensor axis to shard the sequence over
            assert row["sizes"]["y"] == row["sizes"]["x"] == 1, row["sizes"]
            continue
        assert row["sequence_parallel"]
        regather = _memory_of_row(row, "auto", capsys, sp + ["--sequence-parallel-regather"])
        assert row["memory"]["total_bytes"] == regather
        if row["activation_checkpointing"] != "full":
            assert regather < _memory_of_row(row, "auto", capsys, sp)
    rc, out, _ = run(argv + ["--top", "1"], capsys)
    assert rc == 0 and "sp = sequence parallelism, regather" in out


def test_plan_emits_sequence_parallel_regather(tmp_path, capsys):
    """``--emit-config`` of a ``--sequence-parallel-regather`` plan whose row runs sequence
    parallelism writes ``sequence_parallel_regather = true`` in ``[parallelism]``, which
    ``tetrad train``'s config parser reads back; without the flag the key is absent."""
    from tetrad.train.config import load_config

    argv = ["plan", "--model", "llama-3-70b", "--machine", "dgx-h100", "--gpus", "64"]
    argv += ["--global-batch", "128", "--seq-len", "4096", "--top", "1", "--no-classic"]
    argv += ["--sequence-parallel", "on"]
    for flag, want in (["--sequence-parallel-regather"], True), ([], False):
        path = tmp_path / f"{want}.toml"
        rc, _, _ = run(argv + flag + ["--emit-config", str(path)], capsys)
        assert rc == 0
        assert ("sequence_parallel_regather = true" in path.read_text()) == want
        par = load_config(str(path)).parallelism
        assert par.sequence_parallel and par.sequence_parallel_regather == want
