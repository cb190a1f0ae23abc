"""``tetrad plan`` and ``tetrad memory``: their options and what they run.

:mod:`tetrad.cli` builds the sub-commands with :func:`add_plan_arguments` and
:func:`add_memory_arguments` and runs :func:`run_plan` / :func:`run_memory` (on a pipeline grid,
:func:`tetrad.plan.cli_memory.pipeline_memory_text`), which raise
:class:`~tetrad.plan.errors.PlanError` (printed as one line by the command) for bad input. Plain
Python: no torch.
"""

from __future__ import annotations

import argparse
import json
import sys

from tetrad.plan.cli_conflicts import check_memory_settings, check_plan_settings
from tetrad.plan.cli_memory import (
    grid_and_experts,
    pipeline_memory_text,
    residual_arg,
    sequence_parallel_arg,
    sequence_parallel_text,
    weights_text,
)
from tetrad.plan.comm.sublayers import format_sublayers, sublayers
from tetrad.plan.compute.fp8 import FP8_RECIPES
from tetrad.plan.errors import PlanError
from tetrad.plan.machine.description import get_machine, preset_names
from tetrad.plan.memory import fujii
from tetrad.plan.memory.moe import moe_terms
from tetrad.plan.memory.runtime import runtime_memory
from tetrad.plan.memory.sharded_optimizer import SHARD_OPTIMIZER
from tetrad.plan.pipe.schedule import SCHEDULES
from tetrad.plan.pipe.stages import stage_model
from tetrad.plan.question import StepQuestion
from tetrad.plan.search import report
from tetrad.plan.search.fp8_choice import plan_fp8_auto
from tetrad.plan.search.plan import plan
from tetrad.plan.step_time import best_orientation
from tetrad.spec.activation_checkpointing import CHECKPOINTING, parse_checkpointing
from tetrad.spec.conflicts import PIPELINE_DEFAULTS
from tetrad.spec.grid import (
    ORIENTATIONS,
    role_sizes,
)
from tetrad.spec.precision import PARAM_DTYPES, RESIDUAL_DTYPES
from tetrad.spec.presets import PRESETS, get_model
from tetrad.spec.units import GiB


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be at least 1")
    return v


def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of whole numbers"
        ) from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} needs positive whole numbers")
    return vals


PLAN_HELP = "rank 4D (and Megatron-style) configurations by predicted step time"
PLAN_DESCRIPTION = (
    "Enumerate every 4D grid G_data x G_z x G_y x G_x of the GPU count (with a pipeline axis "
    "G_pipe x virtual stages x schedule on top unless --no-pipeline), micro-batch and "
    "activation-checkpointing mode (none, selective, full); drop those estimated above 80%% of "
    "GPU memory; rank the rest by predicted step time. Also ranks the classic TP x CP x PP x DP "
    "space for comparison."
)
MEMORY_HELP = "per-GPU memory estimate of one configuration and the 80%% verdict"
MEMORY_DESCRIPTION = (
    "Memory per GPU of one configuration: fujii2024 (Fujii et al. 2024, Megatron-style "
    "TP/CP/PP/DP) or tetrad (this runtime on a 4D grid)."
)


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``tetrad plan``."""
    models = ", ".join(PRESETS)
    machines = ", ".join(preset_names())
    p.add_argument(
        "--model", required=True, help=f"preset ({models}), a config.json, or sizes key=value,..."
    )
    p.add_argument("--machine", required=True, help=f"preset ({machines}) or a machine TOML file")
    p.add_argument("--gpus", type=_positive_int, metavar="N", help="GPUs (required to rank)")
    p.add_argument(
        "--global-batch",
        type=_positive_int,
        metavar="N",
        help="samples per optimizer step (required to rank)",
    )
    p.add_argument(
        "--sublayers",
        type=_int_list,
        metavar="TP,...",
        help="instead of ranking: T3-style GEMM -> reduce-scatter sublayer times (sequential, "
        "fused, ideal) of the model at these tensor-parallel degrees, --seq-len tokens",
    )
    p.add_argument(
        "--seq-len",
        type=_positive_int,
        default=2048,
        metavar="N",
        help="tokens per sample (default 2048)",
    )
    p.add_argument(
        "--top", type=_positive_int, default=10, metavar="K", help="rows to show (default 10)"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write a PNG of the top configurations")
    p.add_argument(
        "--emit-config",
        metavar="FILE.toml",
        help="write the best 4D configuration as a `tetrad train --config` file",
    )
    p.add_argument(
        "--comm-model",
        choices=("tetrad", "axonn"),
        default="tetrad",
        help="tetrad: the runtime's exact collectives, alpha-beta times and overlap "
        "(default); axonn: AxoNN's published model (bytes/bandwidth, no overlap)",
    )
    p.add_argument(
        "--overlap",
        default="all",
        metavar="LIST",
        help="overlaps the runtime will use: all (default), none, or a list of "
        "prefetch,reduce_scatter,dx_all_reduce,dp_all_reduce,domino,fine,context",
    )
    p.add_argument(
        "--checkpointing",
        "--activation-checkpointing",  # tetrad train's and tetrad memory's name
        dest="checkpointing",
        choices=("auto", *CHECKPOINTING, "on", "off"),
        default="auto",
        help="activation checkpointing: try none, selective and full (auto, default), or only "
        "one (on = full, off = none)",
    )
    p.add_argument(
        "--micro-batch",
        type=_int_list,
        metavar="LIST",
        help="allowed micro-batch sizes, e.g. 1,2,4 (default: every divisor)",
    )
    p.add_argument(
        "--no-classic", action="store_true", help="skip the Megatron-style TP x CP x PP x DP search"
    )
    pipe = p.add_mutually_exclusive_group()
    pipe.add_argument(
        "--no-pipeline",
        action="store_true",
        help="leave the pipeline axis out of the 4D search (searched by default: G_pipe x "
        "virtual stages x schedule on top of the 5D grids)",
    )
    pipe.add_argument("--pipeline", action="store_true", help=argparse.SUPPRESS)  # the default
    p.add_argument(
        "--shard-optimizer",
        choices=SHARD_OPTIMIZER,
        default="auto",
        help="the runtime's sharded optimizer (AdamW states over data x context, ZeRO-1; "
        "rows marked so): auto (each configuration both ways where it fits, ranked by "
        "step time), on, off",
    )
    p.add_argument(
        "--param-dtype",
        choices=PARAM_DTYPES,
        default="fp32",
        help="the weights' stored format in the 4D space (tetrad train --param-dtype; bf16: "
        "fp32 masters with the optimizer states; default fp32, the runtime's default)",
    )
    p.add_argument(
        "--residual-dtype",
        choices=RESIDUAL_DTYPES,
        default="auto",
        help="the residual stream's format in the 4D space (tetrad train --residual-dtype): "
        "auto (default) the compute dtype, bf16 on GPUs; fp32 keeps an fp32 stream (more "
        "saved activations; in the step time only the embedding's sum over Y)",
    )
    p.add_argument(
        "--sequence-parallel",
        **dict(choices=("off", "on", "auto"), nargs="?", const="on", default="off"),
        help="4D grids of a dense model with G_y > 1 with tetrad train --sequence-parallel "
        "(rows marked sp): off (default), on, or auto (each grid with or without, whichever "
        "is faster)",
    )
    p.add_argument(
        "--sequence-parallel-regather",
        action="store_true",
        help="with --sequence-parallel on or auto: the rows with sequence parallelism keep each "
        "layer pair's first Linear's input split along the sequence and gather it again in "
        "backward (tetrad train --sequence-parallel-regather): less memory, one more "
        "all-gather over Y per pair and micro-batch",
    )
    p.add_argument(
        "--gpu-memory-gib", type=float, metavar="GIB", help="GPU memory (default: the machine's)"
    )
    p.add_argument(
        "--moe-imbalance",
        type=float,
        default=1.0,
        metavar="R",
        help="mixture-of-experts models: the busiest rank's routed rows over the mean "
        "(default 1.0: balanced)",
    )
    p.add_argument(
        "--gemm-efficiency",
        type=float,
        metavar="FRACTION",
        help="calibrated fraction of peak for every bf16 GEMM (default: the machine's table; "
        "FP8 GEMMs keep the machine's FP8 table)",
    )
    p.add_argument(
        "--fp8",
        choices=(*FP8_RECIPES, "auto"),
        default="off",
        help="FP8 training (torchao.float8 recipes): the block Linears' GEMMs at the machine's "
        "FP8 rate with their casts; tensorwise also gathers weights over Z in FP8 and "
        "all-reduces their amax; off (default), tensorwise, rowwise, or auto (search with each "
        "and say where FP8 wins and by how much); the 4D space only",
    )


def add_memory_arguments(m: argparse.ArgumentParser) -> None:
    """The options of ``tetrad memory``."""
    models = ", ".join(PRESETS)
    m.add_argument(
        "--model", required=True, help=f"preset ({models}), a config.json, or sizes key=value,..."
    )
    for name in ("tp", "cp", "pp", "dp"):
        m.add_argument(
            f"--{name}",
            type=_positive_int,
            default=1,
            metavar="N",
            help=f"{name.upper()} degree (fujii2024; default 1)",
        )
    m.add_argument("--micro-batch", type=_positive_int, default=1, metavar="N")
    m.add_argument("--seq-len", type=_positive_int, default=2048, metavar="N")
    m.add_argument(
        "--method",
        choices=("fujii2024", "tetrad"),
        help="estimator (default: tetrad when --grid is given, else fujii2024)",
    )
    m.add_argument(
        "--grid",
        metavar="DATA,Z,Y,X",
        help="grid for --method tetrad: DATA,Z,Y,X, DATA,CONTEXT,Z,Y,X, PIPE,DATA,CONTEXT,Z,Y,X "
        "or named (pipe=4,data=2,z=8,y=2,x=2)",
    )
    m.add_argument(
        "--pipeline-schedule",
        choices=SCHEDULES,
        default=PIPELINE_DEFAULTS["pipeline_schedule"],
        help="tetrad with a pipeline axis: the schedule (default 1f1b; in-flight micro-batches)",
    )
    m.add_argument(
        "--virtual-stages",
        type=_positive_int,
        default=PIPELINE_DEFAULTS["virtual_stages"],
        metavar="V",
        help="tetrad with a pipeline axis: stages per pipeline rank (interleaved-1f1b)",
    )
    m.add_argument(
        "--orientation",
        choices=("auto", *ORIENTATIONS),
        default="auto",
        help="tetrad: which grid dimension plays which role of the layer pairs (default auto: "
        "the one tetrad train picks without --machine, fewer bytes on X and Y)",
    )
    m.add_argument(
        "--activation-checkpointing",
        nargs="?",
        const="full",
        default="none",
        metavar="none|selective|selective:K|full",
        help="tetrad: recompute activations in backward (no value: full; selective:K: the last "
        "K blocks selective)",
    )
    m.add_argument(
        "--pipeline-split",
        default="",
        metavar="N,N,...",
        help="tetrad with a pipeline axis: blocks of each stage in pipeline order, the last may "
        "be 0 (default: balanced by the compute of --machine, as tetrad train)",
    )
    m.add_argument(
        "--num-microbatches",
        type=_positive_int,
        metavar="N",
        help="micro-batches per step (pipeline in-flight factor; tetrad with a pipeline axis: "
        "default 8 x pipe)",
    )
    m.add_argument(
        "--gpu-memory-gib",
        type=float,
        metavar="GIB",
        help="GPU memory (default 80, or the --machine's)",
    )
    m.add_argument(
        "--shard-optimizer",
        action="store_true",
        help="tetrad: AdamW states sharded over data x context (tetrad train --shard-optimizer)",
    )
    m.add_argument(
        "--compile",
        action="store_true",
        help="tetrad: the blocks under torch.compile (tetrad train --compile), which save less",
    )
    m.add_argument(
        "--param-dtype",
        choices=PARAM_DTYPES,
        default="fp32",
        help="tetrad: the weights' stored format (tetrad train --param-dtype; bf16: fp32 "
        "masters with the optimizer states, default fp32)",
    )
    m.add_argument(
        "--residual-dtype",
        choices=RESIDUAL_DTYPES,
        default="auto",
        help="tetrad: the residual stream's format (tetrad train --residual-dtype): auto "
        "(default) the compute dtype, bf16 on GPUs; fp32 keeps an fp32 stream",
    )
    m.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="tetrad: the residual stream and norms split along the sequence over the Y role "
        "(tetrad train --sequence-parallel)",
    )
    m.add_argument(
        "--sequence-parallel-regather",
        action="store_true",
        help="tetrad, with --sequence-parallel: each layer pair's first Linear keeps its "
        "input's sequence shard and gathers it again in backward "
        "(tetrad train --sequence-parallel-regather)",
    )
    m.add_argument(
        "--expert-parallel",
        type=_positive_int,
        default=1,
        metavar="N",
        help="tetrad, MoE models: experts split over N consecutive ranks of a pipeline stage "
        "(N divides its ranks; or expert=N in a named --grid)",
    )
    m.add_argument(
        "--moe-imbalance",
        type=float,
        default=1.0,
        metavar="R",
        help="tetrad, MoE models: the busiest rank's routed rows over the mean (default 1.0)",
    )
    m.add_argument("--machine", help="take the GPU memory from this machine")
    m.add_argument("--json", action="store_true", help="print the breakdown as JSON")


def run_plan(args: argparse.Namespace) -> int:
    """``tetrad plan``: print (and optionally plot or emit) the ranked configurations.

    Raises:
        PlanError: bad input; the message says what to change.
    """
    model = get_model(args.model)
    if args.moe_imbalance < 1:
        raise PlanError(f"--moe-imbalance {args.moe_imbalance} must be at least 1.0")
    check_plan_settings(args)
    machine = get_machine(args.machine)
    if args.gemm_efficiency is not None:
        machine = machine.with_gemm_efficiency(args.gemm_efficiency)
    if args.sublayers:
        rows = sublayers(model, machine, args.sublayers, args.seq_len)
        print(format_sublayers(model, machine, rows))
        return 0
    missing = [f for f in ("gpus", "global_batch") if getattr(args, f) is None]
    if missing:
        flags = " and ".join("--" + f.replace("_", "-") for f in missing)
        raise PlanError(f"tetrad plan needs {flags} to rank configurations (or --sublayers TP)")
    mem = None
    if args.gpu_memory_gib is not None:
        if args.gpu_memory_gib <= 0:
            raise PlanError(f"--gpu-memory-gib {args.gpu_memory_gib} must be positive")
        mem = args.gpu_memory_gib * GiB
    ckpt = CHECKPOINTING if args.checkpointing == "auto" else (args.checkpointing,)
    opts = dict(
        top=args.top,
        checkpointing=ckpt,
        micro_batches=args.micro_batch,
        overlaps=args.overlap,
        comm_model=args.comm_model,
        classic=not args.no_classic,
        gpu_memory_bytes=mem,
        pipeline=not args.no_pipeline,
        shard_optimizer=args.shard_optimizer,
        moe_imbalance=args.moe_imbalance,
        params=args.param_dtype,
        sequence_parallel=args.sequence_parallel,
        residual=args.residual_dtype,
        regather=args.sequence_parallel_regather,
    )
    fp8_lines: list[str] = []
    if args.fp8 == "auto":
        result, fp8_lines = plan_fp8_auto(
            model, machine, args.gpus, args.global_batch, args.seq_len, **opts
        )
    else:
        result = plan(
            model, machine, args.gpus, args.global_batch, args.seq_len, fp8=args.fp8, **opts
        )
    if args.emit_config:
        report.emit_config(result.rows[0], model, result, args.emit_config)
    if args.plot:
        report.plot(result, args.plot, args.top)
    if args.json:
        out = report.to_json(result)
        if fp8_lines:
            data = json.loads(out)
            data["fp8_comparison"] = fp8_lines
            out = json.dumps(data, indent=2)
        print(out)
    else:
        print(report.format_result(result) + "".join("\n" + line for line in fp8_lines))
    for flag, path in (("config", args.emit_config), ("plot", args.plot)):
        if path:
            print(f"tetrad: wrote {flag} {path}", file=sys.stderr)
    return 0


def run_memory(args: argparse.Namespace) -> int:
    """``tetrad memory``: print the per-GPU memory of one configuration and the verdict.

    Raises:
        PlanError: bad input; the message says what to change.
    """
    model = get_model(args.model)
    if args.gpu_memory_gib is not None:
        if args.gpu_memory_gib <= 0:
            raise PlanError(f"--gpu-memory-gib {args.gpu_memory_gib} must be positive")
        gpu = args.gpu_memory_gib * GiB
    elif args.machine:
        gpu = float(get_machine(args.machine).memory_bytes)
    else:
        gpu = 80.0 * GiB
    gpu_from = (
        "--gpu-memory-gib"
        if args.gpu_memory_gib is not None
        else f"--machine {args.machine}"
        if args.machine
        else "the default without --machine or --gpu-memory-gib"
    )
    method = args.method or ("tetrad" if args.grid else "fujii2024")
    if method == "tetrad":
        if not args.grid:
            raise PlanError("--method tetrad needs --grid DATA,Z,Y,X (for example 2,1,1,2)")
        pipe, grid, moe = grid_and_experts(args, model)
        expert = moe.get("expert", 1)
        check_memory_settings(args, method, pipe)
        ckpt = parse_checkpointing(args.activation_checkpointing)
        turn = args.orientation
        sp = args.sequence_parallel
        if sp and turn == "auto" and 1 in grid[3:]:  # a lone tensor axis plays Y
            turn = "yx" if grid[4] > 1 else "xy"
        if turn == "auto":
            ctx = StepQuestion(
                model,
                get_machine("dgx-h100"),
                args.seq_len,
                grid[0] * grid[2],
                residual_bytes=4 if args.residual_dtype == "fp32" else None,
            )
            turn = best_orientation(ctx, grid, 1, ckpt)  # the bytes do not depend on the machine
        if pipe > 1:
            if args.compile:
                raise PlanError(
                    "--compile is modelled on grids without a pipeline axis only: drop --compile "
                    "(the eager estimate is an upper bound) or the pipe= size"
                )
            mem, title = pipeline_memory_text(args, model, pipe, grid, turn, ckpt, gpu, moe)
            title = title.replace(
                "\nthe worst rank:",
                f"\nGPU memory {gpu / GiB:.1f} GiB ({gpu_from}); the worst rank:",
            )
        else:
            mem = runtime_memory(
                model,
                role_sizes(grid, turn),
                args.micro_batch,
                args.seq_len,
                gpu,
                activation_checkpointing=ckpt,
                shard_optimizer=args.shard_optimizer,
                compiled=args.compile,
                params=args.param_dtype,
                **residual_arg(args),
                **moe,
                **sequence_parallel_arg(args),
            )
            title = (
                f"{model.summary()}\ntetrad runtime, grid D,C,Z,Y,X={','.join(map(str, grid))} "
                f"({turn}), micro-batch {args.micro_batch} x {args.seq_len} tokens, "
                f"checkpointing {ckpt}"
                + (", AdamW states sharded over data x context" if args.shard_optimizer else "")
                + weights_text(args)
                + (f", expert axis {expert}" if model.is_moe else "")
                + (", blocks compiled" if args.compile else "")
                + sequence_parallel_text(args)
                + f"\nGPU memory {gpu / GiB:.1f} GiB ({gpu_from})"
            )
        # with a pipeline: one stage of the most blocks' (its in-flight copies not included)
        blocks = -(-model.n_layers // pipe)
        terms = moe_terms(
            stage_model(model, blocks) if pipe > 1 else model,
            role_sizes(grid, turn),
            args.micro_batch,
            args.seq_len,
            activation_checkpointing=ckpt,
            shard_optimizer=args.shard_optimizer,
            params=args.param_dtype,
            **moe,
        )
    else:
        if args.grid:
            raise PlanError("--grid is for --method tetrad; fujii2024 takes --tp --cp --pp --dp")
        check_memory_settings(args, method, args.pp)
        mem = fujii.fujii2024(
            model,
            args.tp,
            args.cp,
            args.pp,
            args.dp,
            args.micro_batch,
            args.seq_len,
            gpu,
            num_microbatches=args.num_microbatches,
        )
        title = (
            f"{model.summary()}\nfujii2024, TP={args.tp} CP={args.cp} PP={args.pp} "
            f"DP={args.dp}, micro-batch {args.micro_batch} x {args.seq_len} tokens"
        )
        terms = {}
    if args.json:
        out = {"model": model.name, "method": method, **mem.to_dict()}
        if terms:
            out["moe_terms_bytes"] = terms
        print(json.dumps(out, indent=2))
    elif method == "tetrad":
        advice = {
            "none": "raise G_z*G_y*G_x, lower the micro-batch or add "
            "--activation-checkpointing selective (or full)",
            "selective": "raise G_z*G_y*G_x, lower the micro-batch or use "
            "--activation-checkpointing full",
            "full": "raise G_z*G_y*G_x or lower the micro-batch",
        }[ckpt.partition(":")[0]]
        if model.is_moe:
            advice += ", or raise the expert axis (--expert-parallel)"
        print(report.memory_text(mem, title, advice) + report.moe_terms_text(terms))
    else:
        print(report.memory_text(mem, title, "raise TP, CP or PP, or lower the micro-batch"))
    return 0
