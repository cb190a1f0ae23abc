"""The sections of a training configuration: typed dataclasses, one per TOML table.

Each field is declared with :func:`option`: its default, its one-line help and, where it differs
from the field name, the name of its ``tetrad train`` option; :mod:`tetrad.train.config` builds
the command line and reads TOML files from these declarations. Plain Python (no torch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from tetrad.spec.activation_checkpointing import parse_checkpointing
from tetrad.spec.conflicts import PIPELINE_DEFAULTS
from tetrad.spec.errors import TetradError
from tetrad.spec.grid import GridShape
from tetrad.spec.overlap import CONTEXT_PIECES, DOMINO_MIN_ROWS, DP_BUCKET_BYTES, parse_overlaps
from tetrad.spec.precision import Device
from tetrad.spec.units import MiB

DEMO_GRID: GridShape = (2, 1, 2, 1, 1)  # the fastest 4-process grid for `small` on 2 cores


class ConfigError(TetradError):
    """A configuration file or value that tetrad cannot use; the message says what to change."""


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    metavar: str | None = None,
    name: str | None = None,
    factory: Any = dataclasses.MISSING,
) -> Any:
    """A configuration field: its default, its one-line ``help`` (shown by ``--help``) and,
    where it differs from the field name, the ``name`` of its command-line option."""
    meta = {"help": help, "metavar": metavar, "option": name}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelSection:
    """What to train: a preset or sizes; in TOML, sizes such as n_layers = 8 go in [model] too."""

    name: str = option(
        "small",
        name="model",
        metavar="SPEC",
        help="preset, config.json or sizes, e.g. small, tiny,n_layers=4, dim=512,...",
    )
    sizes: dict = field(default_factory=dict)  # the [model] table's sizes (TOML only)
    init_from: str = option(
        "",
        metavar="hf:PATH",
        help="start from a Hugging Face Llama folder: its sizes, weights and tokenizer.json "
        "(--model is then ignored)",
    )


@dataclass
class DataSection:
    """The text to train on and its tokenizer."""

    paths: list[str] = option(
        factory=list,
        name="data",
        metavar="PATH",
        help="text, .jsonl, .jsonl.gz, .jsonl.zst or .parquet file, folder of them, datasets "
        "folder (save_to_disk), folder written by tetrad prepare, or glob (repeatable); default: "
        "the Python stdlib",
    )
    tokenizer: str = option(
        "", metavar="FILE", help="tokenizer.json (default: train a byte-level BPE on the corpus)"
    )
    vocab_size: int = option(4096, metavar="N", help="size of the BPE trained when no tokenizer")
    val_fraction: float = option(0.01, metavar="F", help="share of the corpus held out")
    text_field: str = option(
        "text", metavar="NAME", help="JSONL field, Parquet or datasets column holding the text"
    )
    encoding_errors: Literal["replace", "strict"] = option(
        "replace",
        help="bytes that are not UTF-8: replace (by U+FFFD, counted) or strict (stop, naming "
        "the file and byte offset)",
    )
    workers: int = option(
        0,
        metavar="N",
        help="processes tokenizing --data when it is not a prepared folder (0: this process, "
        "with the tokenizer's threads)",
    )
    skip_bad_files: bool = option(
        False,
        help="leave out damaged --data inputs (a cut or corrupt .gz, .zst or Parquet file: each "
        "read through first), counted and named, instead of stopping at the first",
    )


@dataclass
class ParallelismSection:
    """How the work is split over processes and which collectives overlap computation."""

    grid: GridShape | Literal["auto"] = option(
        DEMO_GRID,
        metavar="[PIPE,]DATA,[CONTEXT,]Z,Y,X",
        help="process grid DATA,Z,Y,X, DATA,CONTEXT,Z,Y,X or PIPE,DATA,CONTEXT,Z,Y,X, e.g. "
        "1,2,1,2, or named sizes such as pipe=2,data=2,y=2 (others 1), or auto (the planner "
        "picks it)",
    )
    pipe: int = option(
        1, metavar="N", help="pipeline stages G_pipe (set by a six-entry or pipe= --grid)"
    )
    expert_parallel: int = option(
        1,
        metavar="N",
        help="expert parallelism G_expert of an MoE model: its routed experts split over N "
        "consecutive ranks of a pipeline stage (X first, then Y, Z, context, data), tokens "
        "exchanged by all-to-all (N divides G_data*G_context*G_z*G_y*G_x and n_experts; also "
        "expert=N in a named --grid)",
    )
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = option(
        PIPELINE_DEFAULTS["pipeline_schedule"],
        help="pipeline schedule (torch.distributed.pipelining's) when G_pipe > 1",
    )
    virtual_stages: int = option(
        PIPELINE_DEFAULTS["virtual_stages"],
        metavar="V",
        help="stages per pipeline rank (2 or more: interleaved-1f1b)",
    )
    pipeline_split: str = option(
        "",
        metavar="N,N,...",
        help="blocks of each pipeline stage, in pipeline order (G_pipe x V counts summing to the "
        "model's blocks, the last may be 0: the LM head's stage alone; for example Megatron's "
        "even split); default: balanced by the "
        "planner's compute with --machine, else counting the embedding and the head as a "
        "block each",
    )
    orientation: Literal["auto", "xy", "yx"] = option(
        "auto",
        help="which grid dimension plays which role of the layer pairs: xy (a pair's first "
        "layer splits its input over X), yx (its output over X: with X alone, Megatron's "
        "column-then-row layout), or auto (the one whose X and Y collectives send fewer "
        "bytes; with --machine, the faster)",
    )
    overlap: str = option(
        "all",
        metavar="LIST",
        help="overlapped collectives: all, none, or a list of prefetch,"
        "reduce_scatter,dx_all_reduce,dp_all_reduce,domino,fine,context,expert (all: domino "
        "and fine only where the planner predicts a gain on --machine)",
    )
    fine_chunks: int = option(
        0,
        metavar="N",
        help="pieces per ring step of the fine overlap (0: the planner's choice on --machine, "
        "else 2)",
    )
    context_pieces: int = option(
        0,
        metavar="N",
        help="most pieces of the context overlap's K/V all-gather (0: the planner's choice on "
        f"--machine, else 1: one blocking all-gather; {CONTEXT_PIECES} is a good start on GPUs)",
    )
    shard_optimizer: bool = option(
        False,
        help="shard the AdamW states over the data x context ranks (ZeRO-1, Megatron's "
        "distributed optimizer): gradients reduce-scattered, parameters all-gathered over them",
    )
    sequence_parallel: bool = option(
        False,
        help="split the residual stream and the norms along the sequence over the tensor axis "
        "in the Y role (y=N, or x=N alone: Megatron-LM's sequence parallelism; with both, "
        "as the stream is over X): their activations divided by N, each layer pair's all-reduce an "
        "all-gather plus a reduce-scatter of the same bytes; with grid auto, where the planner "
        "finds it faster",
    )
    sequence_parallel_regather: bool = option(
        False,
        help="with --sequence-parallel: each layer pair's first Linear keeps its input's "
        "sequence shard and all-gathers it again in backward (Megatron-LM's choice) instead of "
        "keeping it gathered: saved activations lower by that copy's (N-1)/N, one more "
        "all-gather over Y per pair and micro-batch",
    )
    dp_bucket_mb: float = option(
        DP_BUCKET_BYTES / MiB, metavar="MB", help="data-parallel all-reduce bucket size, MiB"
    )
    domino_min_rows: int = option(
        DOMINO_MIN_ROWS, metavar="N", help="split a forward GEMM + all-reduce only with >= 2N rows"
    )
    activation_checkpointing: str = option(
        "none",
        metavar="none|selective|selective:K|full|auto",
        help="recompute activations in backward to save memory: selective (norms, RoPE, "
        "SwiGLU; no GEMM or collective), selective:K (the last K blocks selective, the others "
        "none) or full (every block); true/false mean full/none; auto (with grid auto): the "
        "planner chooses it with the grid",
    )
    machine: str = option(
        "",
        metavar="NAME|FILE.toml",
        help="machine for the planner (grid auto, Domino and fine choice): a preset "
        "such as dgx-h100 or the file `tetrad calibrate` writes",
    )
    nproc: int = option(
        0, metavar="N", help="processes for grid auto without torchrun (0: GPUs, or 4 on CPU)"
    )

    def __post_init__(self) -> None:
        # one of tetrad.spec.activation_checkpointing.CHECKPOINTING from a name, on/off or a TOML
        # bool, or "auto" (raises tetrad.spec.activation_checkpointing.CheckpointingError, which
        # says what to give)
        if str(self.activation_checkpointing).strip().lower() == "auto":
            self.activation_checkpointing = "auto"
        else:
            self.activation_checkpointing = parse_checkpointing(
                self.activation_checkpointing, also="auto (the planner's choice)"
            )

    def check_resolved(self) -> None:
        """The planner's choices are made: no ``auto`` grid or checkpointing mode is left.

        Raises:
            ConfigError: ``auto`` still there (or ``auto`` checkpointing with a fixed grid).
        """
        if self.grid == "auto":
            raise ConfigError(
                "grid 'auto' must be resolved by the planner before training "
                "(tetrad train does this; see tetrad.train.auto.choose_grid)"
            )
        if self.activation_checkpointing == "auto":
            raise ConfigError(
                "activation_checkpointing 'auto' is chosen with the grid by --grid auto: "
                "use --grid auto, or name none, selective or full"
            )

    @property
    def overlaps(self) -> frozenset[str]:
        """The overlap names of :attr:`overlap` (checked by :meth:`TrainConfig.check`)."""
        return parse_overlaps(self.overlap)

    @property
    def named_overlaps(self) -> frozenset[str]:
        """The overlaps named one by one in :attr:`overlap` (empty for ``all`` and ``none``)."""
        names = {t.strip() for t in self.overlap.split(",")}
        return frozenset() if names & {"all", "none"} else frozenset(names)


@dataclass
class TrainingSection:
    """The optimisation: batch, schedule, AdamW, device."""

    steps: int = option(300, metavar="N", help="optimizer steps of the whole run")
    micro_batch: int = option(4, metavar="N", help="samples per rank per micro-step")
    global_batch: int = option(16, metavar="N", help="samples per optimizer step")
    seq_len: int = option(256, metavar="N", help="tokens per sample")
    lr: float = option(3e-3, metavar="LR", help="peak learning rate")
    min_lr: float = option(3e-4, metavar="LR", help="learning rate at the end of the cosine")
    warmup_steps: int = option(30, metavar="N", help="linear warm-up steps")
    weight_decay: float = option(0.1, metavar="W", help="AdamW weight decay (matrices only)")
    beta1: float = option(0.9, metavar="B", help="AdamW beta1")
    beta2: float = option(0.95, metavar="B", help="AdamW beta2")
    grad_clip: float = option(1.0, metavar="NORM", help="max global gradient norm (0: off)")
    seed: int = option(1234, metavar="N", help="random seed (initial weights, batches)")
    device: Device = option("cpu", help="cpu (gloo, fp32) or cuda (NCCL, bf16 autocast)")
    compile: bool = option(
        False, help="torch.compile each transformer block (the collectives stay eager)"
    )


@dataclass
class PrecisionSection:
    """Numeric formats (:mod:`tetrad.spec.precision`): how the weights are stored and summed."""

    params: Literal["fp32", "bf16"] = option(
        "fp32",
        name="param_dtype",
        help="format the weights are stored in: bf16 keeps fp32 master weights in the "
        "optimizer (sharded with it under --shard-optimizer) and fp32 gradients, and computes "
        "in bf16 on every device (Megatron-LM's mixed precision); fp32: fp32 weights",
    )
    grad_reduce: Literal["fp32", "bf16"] = option(
        "fp32",
        name="grad_reduce_dtype",
        help="format of the gradients' sum over data x context (all-reduce or reduce-scatter)",
    )
    residual: Literal["auto", "fp32", "bf16"] = option(
        "auto",
        name="residual_dtype",
        help="format of the residual stream (embedding output, residual adds, norms' input and "
        "output, stage boundaries): auto is the compute dtype (bf16 on cuda or with "
        "--param-dtype bf16, as Megatron-LM; fp32 otherwise); fp32 keeps an fp32 stream",
    )
    fp8: Literal["off", "tensorwise", "rowwise"] = option(
        "off",
        help="FP8 GEMMs in the transformer blocks' Linears, torchao.float8's recipe of that name "
        "(tensorwise: a scale per tensor, the weights all-gathered over Z in FP8; rowwise: per "
        "row, small Linears kept in the compute dtype); the embedding, LM head, router and "
        "experts stay in the compute dtype; needs torchao (pip install 'tetrad[fp8]'); on the "
        "CPU torchao emulates the FP8 GEMMs",
    )


@dataclass
class CheckpointSection:
    """Where the run lives, its checkpoints, and restarts after a failure."""

    run_dir: str = option("runs/demo", metavar="DIR", help="where logs and checkpoints go")
    checkpoint_every: int = option(
        0, metavar="N", help="steps between checkpoints (0: only at the end)"
    )
    keep_last: int = option(
        0, metavar="K", help="complete checkpoints kept, older ones removed (0: all)"
    )
    async_save: Literal["auto", "on", "off"] = option(
        "auto",
        help="write checkpoints in the background, the loop waiting only for the copy to host "
        "memory: on, off, or auto (on with cuda; off on cpu, where the writing competes with "
        "training for the cores)",
    )
    resume: bool = option(
        False, help="continue from the run dir's latest checkpoint (an error if it has none)"
    )
    save_on_signal: bool = option(
        True,
        help="on SIGTERM, SIGUSR1 or Ctrl-C, finish the step, save a checkpoint and stop "
        "(exit code 143, or 130 after Ctrl-C; a second Ctrl-C stops at once)",
    )
    max_restarts: int = option(
        0,
        metavar="N",
        help="restart the local workers up to N times after a failure, resuming from the "
        "latest checkpoint (under torchrun: torchrun --max-restarts)",
    )


@dataclass
class LoggingSection:
    """What is reported, and how often."""

    log_every: int = option(10, metavar="N", help="steps between log lines")
    val_every: int = option(50, metavar="N", help="steps between validations (and at the end)")
    val_batches: int = option(4, metavar="N", help="global batches per validation")
    profile_steps: str = option(
        "", metavar="A:B", help="write a torch.profiler Chrome trace of steps A..B"
    )
    peak_flops: float = option(
        0.0, metavar="FLOP/S", help="peak FLOP/s per rank for MFU (0: look up or measure)"
    )
    tensorboard: bool = option(
        False, help="also write the metrics as TensorBoard scalars to RUN_DIR/tensorboard"
    )

    def profile_range(self) -> tuple[int, int] | None:
        """Steps ``(A, B)`` (1-based, inclusive) to profile, or None.

        Raises:
            ConfigError: not ``A:B`` with ``1 <= A <= B``.
        """
        if not self.profile_steps:
            return None
        try:
            a, b = (int(v) for v in self.profile_steps.split(":"))
        except ValueError:
            a = b = 0
        if not 1 <= a <= b:
            raise ConfigError(
                f"profile_steps={self.profile_steps!r} is not A:B with 1 <= A <= B "
                "(for example 5:7)"
            )
        return a, b
