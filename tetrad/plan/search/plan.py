"""Both searches of ``tetrad plan``: the 4D space (:mod:`tetrad.plan.search.four_d`) and the
classic Megatron-style space beside it (:mod:`tetrad.plan.search.classic`)."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator

from tetrad.plan.errors import PlanError
from tetrad.plan.machine.description import Machine
from tetrad.plan.memory.formats import residual_option
from tetrad.plan.question import StepQuestion
from tetrad.plan.search.classic import search_classic
from tetrad.plan.search.four_d import search_4d
from tetrad.plan.search.moe import search_moe_4d, search_moe_classic
from tetrad.plan.search.rows import SearchResult
from tetrad.spec.activation_checkpointing import CHECKPOINTING
from tetrad.spec.model import ModelSpec
from tetrad.spec.units import GiB


def plan(
    model: ModelSpec,
    machine: Machine,
    gpus: int,
    global_batch: int,
    seq_len: int,
    *,
    top: int = 10,
    checkpointing: tuple[str | bool, ...] = CHECKPOINTING,
    micro_batches: tuple[int, ...] | None = None,
    overlaps="all",
    comm_model: str = "tetrad",
    classic: bool = True,
    dtype: str = "bf16",
    gpu_memory_bytes: float | None = None,
    pipeline: bool = True,
    classic_pipeline: bool = True,
    shard_optimizer: str = "auto",
    moe_imbalance: float = 1.0,
    fp8: str = "off",
    params: str = "fp32",
    sequence_parallel: bool | str = False,
    residual: str = "auto",
    regather: bool = False,
) -> SearchResult:
    """Both searches; see :func:`search_4d` (``pipeline``: with the pipeline axis, on by
    default: ``docs/planner.md`` section 8) and :func:`search_classic` (``classic_pipeline``:
    with interleaving and uneven splits); ``shard_optimizer``: ``auto``, ``on`` or ``off``
    (:func:`search_4d`). A mixture-of-experts model takes the searches of
    :mod:`tetrad.plan.search.moe` (the expert axis beside the others; ``moe_imbalance``: the
    busiest rank's routed rows over the mean; the 4D space with the ``tetrad`` model only).
    ``fp8``: the FP8 recipe of the 4D step model (:mod:`tetrad.plan.compute.fp8`; dense models,
    ``tetrad`` comm model); with FP8 the classic space, modelled in bf16 only, is not searched.
    ``params``: the weights' stored format of the 4D space (``tetrad train --param-dtype``:
    ``fp32``, or ``bf16`` with fp32 masters; dense models); the classic space keeps
    Megatron-LM's bf16 weights with fp32 masters either way.
    ``sequence_parallel``: the 4D space with ``--sequence-parallel`` where it runs,
    ``off``, ``on`` or ``auto`` (:func:`search_4d`; dense models).
    ``residual``: the residual stream's format of the 4D space (``tetrad train
    --residual-dtype``: ``auto``, the compute dtype's, ``fp32`` or ``bf16``; dense models):
    its memory (:func:`search_4d`); the classic space keeps Megatron-LM's bf16 activations.
    ``regather``: where the 4D space runs sequence parallelism, each pair's first Linear keeps
    its input's sequence shard and all-gathers it again in backward (``tetrad train
    --sequence-parallel-regather``): its memory and step time (:func:`search_4d`; ignored
    where ``sequence_parallel`` is off, which ``tetrad plan`` refuses through
    :mod:`tetrad.spec.conflicts`).

    Raises:
        PlanError: bad inputs, or no 4D configuration at all (message says what to change);
            FP8 with a mixture-of-experts model, the axonn comm model or a machine without it.
    """
    t0 = time.perf_counter()
    if fp8 != "off":
        if model.is_moe:
            raise PlanError(
                f"--fp8 {fp8} is modelled for dense models only; {model.name} is a "
                "mixture-of-experts model: use --fp8 off"
            )
        if comm_model != "tetrad":
            raise PlanError(f"--fp8 {fp8} is modelled with --comm-model tetrad only")
        classic = False
    if residual_option(dtype, residual) is not None and model.is_moe:
        raise PlanError(
            f"--residual-dtype {residual} is searched for dense models only; {model.name} is a "
            "mixture-of-experts model: use --residual-dtype auto (tetrad memory models it)"
        )
    if model.is_moe:
        if comm_model != "tetrad":
            raise PlanError(
                f"--comm-model {comm_model} has no model of {model.name}'s experts: use tetrad"
            )
        return _plan_moe(
            model,
            machine,
            gpus,
            global_batch,
            seq_len,
            top=top,
            checkpointing=checkpointing,
            micro_batches=micro_batches,
            overlaps=overlaps,
            classic=classic,
            dtype=dtype,
            gpu_memory_bytes=gpu_memory_bytes,
            pipeline=pipeline,
            shard_optimizer=shard_optimizer,
            imbalance=moe_imbalance,
            params=params,
            t0=t0,
        )
    with _no_cycle_collection():
        rows, stats = search_4d(
            model,
            machine,
            gpus,
            global_batch,
            seq_len,
            top=top,
            checkpointing=checkpointing,
            micro_batches=micro_batches,
            overlaps=overlaps,
            comm_model=comm_model,
            dtype=dtype,
            gpu_memory_bytes=gpu_memory_bytes,
            pipeline=pipeline,
            shard_optimizer=shard_optimizer,
            fp8=fp8,
            params=params,
            sequence_parallel=sequence_parallel,
            residual=residual,
            regather=regather,
        )
        crow, cstats = ([], {})
        if classic:
            crow, cstats = search_classic(
                model,
                machine,
                gpus,
                global_batch,
                seq_len,
                top=top,
                checkpointing=checkpointing,
                micro_batches=micro_batches,
                gpu_memory_bytes=gpu_memory_bytes,
                pipeline=classic_pipeline,
            )
    inputs = _inputs(model, machine, gpus, global_batch, seq_len, overlaps, gpu_memory_bytes)
    inputs |= {"comm_model": comm_model, "dtype": dtype, "shard_optimizer": shard_optimizer}
    inputs |= {"fp8": fp8, "param_dtype": params, "residual_dtype": residual}
    if sequence_parallel not in (False, "off"):
        inputs["sequence_parallel"] = {True: "on"}.get(sequence_parallel, sequence_parallel)
        if regather:
            inputs["sequence_parallel_regather"] = True
    all_stats = {"four_d": stats, "classic": cstats, "seconds": time.perf_counter() - t0}
    return SearchResult(rows, crow, all_stats, inputs)


def _inputs(
    model: ModelSpec,
    machine: Machine,
    gpus: int,
    global_batch: int,
    seq_len: int,
    overlaps,
    gpu_memory_bytes: float | None,
) -> dict:
    """The question a search answered, as :attr:`SearchResult.inputs` reports it (the overlaps
    the step model runs, the GPU memory in GiB)."""
    question = StepQuestion(model, machine, seq_len, global_batch, overlaps=overlaps)
    return {
        "model": model.name,
        "model_summary": model.summary(),
        "machine": machine.name,
        "machine_summary": machine.summary(),
        "gpus": gpus,
        "global_batch": global_batch,
        "seq_len": seq_len,
        "overlaps": sorted(question.overlaps),
        "gpu_memory_gib": (gpu_memory_bytes or machine.memory_bytes) / GiB,
    }


def _plan_moe(
    model: ModelSpec,
    machine: Machine,
    gpus: int,
    global_batch: int,
    seq_len: int,
    *,
    t0: float,
    classic: bool,
    imbalance: float,
    **opts,
) -> SearchResult:
    """:func:`plan` of a mixture-of-experts model (:mod:`tetrad.plan.search.moe`)."""
    with _no_cycle_collection():
        rows, stats = search_moe_4d(
            model, machine, gpus, global_batch, seq_len, imbalance=imbalance, **opts
        )
        crow, cstats = ([], {})
        if classic:
            crow, cstats = search_moe_classic(
                model,
                machine,
                gpus,
                global_batch,
                seq_len,
                top=opts["top"],
                checkpointing=opts["checkpointing"],
                micro_batches=opts["micro_batches"],
                gpu_memory_bytes=opts["gpu_memory_bytes"],
                imbalance=imbalance,
            )
    memory = opts["gpu_memory_bytes"]
    inputs = _inputs(model, machine, gpus, global_batch, seq_len, opts["overlaps"], memory)
    inputs |= {"comm_model": "tetrad", "dtype": opts["dtype"]}
    inputs |= {"shard_optimizer": opts["shard_optimizer"], "moe_imbalance": imbalance}
    inputs |= {"param_dtype": opts["params"]}
    all_stats = {"four_d": stats, "classic": cstats, "seconds": time.perf_counter() - t0}
    return SearchResult(rows, crow, all_stats, inputs)


@contextlib.contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """Python's cyclic garbage collector off for the searches: they build millions of
    short-lived tuples and dicts (freed by reference counting, no cycles to find), and the
    collector's passes over them (and over all of torch's objects) took about a fifth of a
    16,384-GPU search in the `tetrad plan` process (docs/planner.md section 8).
    Restored afterwards, also on an error; before, what the search keeps (its module-level
    caches) and every older object are moved to the permanent generation (:func:`gc.freeze`),
    so that the collection the allocations made meanwhile set off walks none of them (about
    20 ms at 16,384 GPUs)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.freeze()
            gc.enable()
