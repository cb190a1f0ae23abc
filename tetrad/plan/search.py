"""Search: every 4D grid, micro-batch and checkpointing choice, ranked by predicted step time;
and the classic Megatron-style (TP, PP, CP, DP) space beside it.

4D space (tetrad / AxoNN): every ordered factorisation ``G_data * G_z * G_y * G_x = GPUs`` whose
sizes shard the model (:func:`tetrad.plan.memory.grid_problems`) and split the global batch
(``B % (G_data G_z) == 0``); every micro-batch ``b`` dividing ``B / (G_data G_z)``; activation
checkpointing on and off. Configurations whose :func:`tetrad.plan.memory.tetrad` estimate is
above 80% of GPU memory are dropped (Fujii et al., arXiv 2411.06465); memory grows with ``b``,
so the micro-batch loop stops at the first that does not fit. The survivors are ranked by
:func:`tetrad.plan.comm.estimate` (``comm_model="tetrad"``) or by compute plus AxoNN's
communication time (``comm_model="axonn"``, :func:`tetrad.plan.comm.axonn_comm`).

Classic space (Megatron-LM): ``TP * PP * CP * DP = GPUs`` with ``TP * CP <= GPUs per node``
(Fujii et al.'s search, ``optimal_setting_search.py``), ``TP`` dividing heads, KV heads and the
FFN, ``PP`` dividing the layers, ``S % (2 CP) == 0``; memory from
:func:`tetrad.plan.memory.fujii2024`; time from :func:`megatron_estimate`.

Speed: bandwidths are cached per (stride, size), compute per (G_y, G_x, b), grid validity per
(G_z, G_y, G_x); a candidate is fully evaluated only if its compute time alone (a lower bound)
can still enter the top list.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

from tetrad.plan import memory
from tetrad.plan.comm import Context, axonn_comm, estimate
from tetrad.plan.compute import (
    ELEMENTWISE,
    attention_fwd_flops,
    model_flops_per_step,
)
from tetrad.plan.machines import Machine
from tetrad.plan.models import ModelSpec, PlanError
from tetrad.plan.network import ALL_GATHER, REDUCE_SCATTER
from tetrad.spec import COMM_AXES, GiB

CLASSIC_AXES = ("tp", "cp", "pp", "dp")


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n``, ascending."""
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]


def factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    """Every ordered tuple of ``parts`` positive integers whose product is ``n``."""
    if parts == 1:
        return [(n,)]
    return [(d, *rest) for d in divisors(n) for rest in factorizations(n // d, parts - 1)]


@dataclass
class Row:
    """One ranked configuration, explaining itself.

    Attributes:
        space: ``"4d"`` or ``"classic"``.
        sizes: ``{"data", "z", "y", "x"}`` or ``{"tp", "cp", "pp", "dp"}`` -> size.
        micro_batch: samples per micro-batch (per (data, z) cell; per DP x CP rank in classic).
        grad_accum: micro-batches per step.
        activation_checkpointing: full recomputation of every block.
        step_s: predicted seconds per optimizer step.
        compute_s: compute seconds (GEMMs, attention, element-wise, optimizer; recompute incl.).
        recompute_s: of which recomputation.
        exposed_s: exposed communication seconds per axis.
        comm_s: all communication seconds per axis (exposed + hidden).
        other_s: other named terms (classic: ``pipeline_bubble``).
        tokens_per_s: ``B S / step_s``.
        mfu: model FLOPs utilisation.
        memory: the memory estimate.
        comm_model: ``tetrad``, ``axonn`` or ``megatron``.
        other_s: other named terms (classic: ``pipeline_bubble``).
        hfu: hardware FLOPs utilisation (model FLOPs plus the recomputed forward), the measure
            AxoNN and Megatron-LM report as "% of peak".
    """

    space: str
    sizes: dict
    micro_batch: int
    grad_accum: int
    activation_checkpointing: bool
    step_s: float
    compute_s: float
    recompute_s: float
    exposed_s: dict
    comm_s: dict
    tokens_per_s: float
    mfu: float
    memory: memory.MemoryBreakdown
    comm_model: str
    other_s: dict = field(default_factory=dict)
    hfu: float = 0.0

    @property
    def grid(self) -> tuple[int, ...]:
        """``(G_data, G_z, G_y, G_x)`` or ``(TP, CP, PP, DP)``."""
        keys = ("data", "z", "y", "x") if self.space == "4d" else CLASSIC_AXES
        return tuple(self.sizes[k] for k in keys)

    def finish(
        self, model: ModelSpec, machine: Machine, gpus: int, global_batch: int, seq_len: int
    ) -> Row:
        """Fill in tokens/s, MFU and HFU from ``step_s``; returns self."""
        self.tokens_per_s = global_batch * seq_len / self.step_s
        denom = self.step_s * gpus * machine.peak_flops
        self.mfu = model_flops_per_step(model, global_batch, seq_len) / denom
        rec = (
            recompute_flops_per_step(model, global_batch, seq_len)
            if self.activation_checkpointing
            else 0.0
        )
        self.hfu = self.mfu + rec / denom
        return self

    def label(self) -> str:
        if self.space == "4d":
            return "D,Z,Y,X=" + ",".join(str(v) for v in self.grid)
        return "TP,CP,PP,DP=" + ",".join(str(v) for v in self.grid)

    def to_dict(self) -> dict:
        return {
            "space": self.space,
            "sizes": dict(self.sizes),
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "activation_checkpointing": self.activation_checkpointing,
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "recompute_s": self.recompute_s,
            "exposed_comm_s": dict(self.exposed_s),
            "comm_s": dict(self.comm_s),
            "other_s": dict(self.other_s),
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "comm_model": self.comm_model,
            "memory": self.memory.to_dict(),
        }


@dataclass
class SearchResult:
    """Ranked rows of both spaces and what the search looked at.

    Attributes:
        rows: the best 4D configurations, fastest first.
        classic: the best Megatron-style configurations, fastest first.
        stats: counts (grids enumerated, valid, candidates, fitting, evaluated) and seconds.
        inputs: the question (model, machine, GPUs, batch, sequence, options).
    """

    rows: list[Row]
    classic: list[Row]
    stats: dict
    inputs: dict

    def to_dict(self) -> dict:
        return {
            "inputs": dict(self.inputs),
            "stats": dict(self.stats),
            "four_d": [r.to_dict() for r in self.rows],
            "classic": [r.to_dict() for r in self.classic],
        }


def recompute_flops_per_step(model: ModelSpec, global_batch: int, seq_len: int) -> float:
    """FLOPs of recomputing every block's forward once: ``L (2 N_block + 2 S a d)`` per token
    (the forward third of :meth:`ModelSpec.flops_per_token` without the LM head)."""
    block = sum(lin.count * lin.weight_elements for lin in model.linears())
    return model.n_layers * (2.0 * block + 2.0 * seq_len * model.q_dim) * global_batch * seq_len


def _check_inputs(model: ModelSpec, gpus: int, global_batch: int, seq_len: int) -> None:
    for name, v in (("gpus", gpus), ("global batch", global_batch), ("sequence length", seq_len)):
        if int(v) != v or v < 1:
            raise PlanError(f"{name} {v} must be a positive integer")
    if model.max_positions and seq_len > model.max_positions:
        raise PlanError(
            f"--seq-len {seq_len} exceeds {model.name}'s {model.max_positions} "
            f"learned positions: use --seq-len <= {model.max_positions} or raise "
            "max_positions"
        )


def _nearby_gpu_counts(model: ModelSpec, gpus: int) -> str:
    """The powers of two nearest ``gpus`` that have a grid sharding ``model`` with
    ``G_y G_x > 1`` possible (for error messages), nearest first."""
    found = []
    for e in range(0, 21):
        p = 2**e
        if any(not memory.grid_problems(model, g) for g in factorizations(p, 4)):
            found.append(p)
    found.sort(key=lambda p: (abs(p - gpus), p))
    return ", ".join(str(f) for f in found[:2]) if found else "a power of two"


# =============================================================================================
# 4D search
# =============================================================================================


def search_4d(
    model: ModelSpec,
    machine: Machine,
    gpus: int,
    global_batch: int,
    seq_len: int,
    *,
    top: int = 10,
    checkpointing: tuple[bool, ...] = (False, True),
    micro_batches: tuple[int, ...] | None = None,
    overlaps="all",
    comm_model: str = "tetrad",
    dtype: str = "bf16",
    gpu_memory_bytes: float | None = None,
) -> tuple[list[Row], dict]:
    """The ``top`` fastest fitting 4D configurations and search statistics.

    Args:
        checkpointing: activation-checkpointing choices to try.
        micro_batches: allowed micro-batch sizes (default: every divisor).
        overlaps: the runtime's overlaps assumed on (``"all"``, ``"none"`` or names).
        comm_model: ``"tetrad"`` (runtime-exact, alpha-beta, overlap) or ``"axonn"``.
        gpu_memory_bytes: override of the machine's memory.

    Raises:
        PlanError: no grid shards the model, no grid splits the batch, or nothing fits; the
            message says what to change.
    """
    _check_inputs(model, gpus, global_batch, seq_len)
    if comm_model not in ("tetrad", "axonn"):
        raise PlanError(f"comm model {comm_model!r} is unknown: use tetrad or axonn")
    t0 = time.perf_counter()
    mem_bytes = float(gpu_memory_bytes or machine.memory_bytes)
    ctx = Context(
        model,
        machine,
        seq_len,
        global_batch,
        overlaps=overlaps,
        compute_bytes=2 if dtype == "bf16" else 4,
    )
    prefetch = "prefetch" in ctx.overlaps
    allowed = set(micro_batches) if micro_batches else None
    L = model.n_layers
    stats = {
        "grids": 0,
        "valid_grids": 0,
        "batch_grids": 0,
        "candidates": 0,
        "fitting": 0,
        "evaluated": 0,
    }
    valid: dict = {}
    cands = []  # (lower bound, grid, b, ckpt)
    limit = memory.FIT_FRACTION * mem_bytes
    for grid in factorizations(gpus, 4):
        stats["grids"] += 1
        gd, gz, gy, gx = grid
        key = (gz, gy, gx)
        ok = valid.get(key)
        if ok is None:
            ok = valid[key] = not memory.grid_problems(model, grid)
        if not ok:
            continue
        stats["valid_grids"] += 1
        if global_batch % (gd * gz):
            continue
        stats["batch_grids"] += 1
        # exact floor: fp32 parameters + gradients + two AdamW states = 16 B per local element
        block, block_el, head_el, emb_el = ctx.weight_shards(gx, gy, gz)
        static = 16.0 * (L * block_el + head_el + emb_el + ctx.vector_elements(gx, gy))
        if static > limit:
            continue
        per_cell = global_batch // (gd * gz)
        sizes = [b for b in divisors(per_cell) if allowed is None or b in allowed]
        for ckpt in checkpointing:
            peak = _memory_line(model, grid, seq_len, mem_bytes, ckpt, dtype, prefetch, sizes)
            for b in sizes:
                stats["candidates"] += 1
                if peak(b) > limit:
                    break
                stats["fitting"] += 1
                comp = ctx.compute(grid, b)
                fwd, bwd, rec = comp.micro_batch_seconds(L, ckpt)
                cands.append(((per_cell // b) * (fwd + bwd + rec), grid, b, ckpt))
    if stats["valid_grids"] == 0:
        raise PlanError(
            f"no 4D grid of {gpus} GPUs shards {model.name} (sizes must divide "
            f"hidden, heads, FFN and vocabulary): use a GPU count such as "
            f"{_nearby_gpu_counts(model, gpus)}"
        )
    if stats["batch_grids"] == 0:
        least = min(g[0] * g[1] for g in factorizations(gpus, 4) if valid.get(g[1:]))
        raise PlanError(
            f"global batch {global_batch} does not split over G_data*G_z on any grid "
            f"of {gpus} GPUs that shards {model.name} (the smallest G_data*G_z is "
            f"{least}): use a --global-batch that is a multiple of {least}, or "
            f"--gpus {_nearby_gpu_counts(model, gpus).split(',')[0]}"
        )
    if not cands:
        raise PlanError(
            f"no 4D configuration of {model.name} fits under 80% of "
            f"{mem_bytes / GiB:.0f} GiB per GPU on {gpus} GPUs (batch "
            f"{global_batch} x {seq_len}): use more --gpus, a shorter --seq-len, "
            "a smaller model or a machine with more memory"
        )
    cands.sort(key=lambda c: c[0])
    best: list = []  # max-heap of (-step, seq, row-data) of size top
    for seq, (lb, grid, b, ckpt) in enumerate(cands):
        if len(best) >= top and lb >= -best[0][0]:
            break
        stats["evaluated"] += 1
        if comm_model == "tetrad":
            est = estimate(ctx, grid, b, ckpt)
            step = est.step_s
            item = (-step, seq, (grid, b, ckpt, est))
        else:
            acc = global_batch // (grid[0] * grid[1] * b)
            comp = ctx.compute(grid, b)
            fwd, bwd, rec = comp.micro_batch_seconds(L, ckpt)
            ax = axonn_comm(model, machine, grid, global_batch, seq_len, acc)
            step = acc * (fwd + bwd + rec) + ax["total"]
            item = (-step, seq, (grid, b, ckpt, (ax, acc * (fwd + bwd + rec), acc * rec, acc)))
        if len(best) < top:
            heapq.heappush(best, item)
        elif step < -best[0][0]:
            heapq.heapreplace(best, item)
    rows = []
    for neg, _, (grid, b, ckpt, est) in sorted(best, key=lambda t: (-t[0], t[1])):
        step = -neg
        mem = memory.tetrad(
            model,
            grid,
            b,
            seq_len,
            mem_bytes,
            activation_checkpointing=ckpt,
            dtype=dtype,
            prefetch=prefetch,
        )
        if comm_model == "tetrad":
            est = estimate(ctx, grid, b, ckpt)  # with the optimizer term (local params)
            compute_s, rec_s, exposed, comm_s, acc = (
                est.compute_s,
                est.recompute_s,
                est.exposed_s,
                est.comm_s,
                est.grad_accum,
            )
            step = est.step_s
        else:
            ax, compute_s, rec_s, acc = est
            exposed = {a: ax.get(a, 0.0) for a in COMM_AXES}
            comm_s = dict(exposed)
        rows.append(
            Row(
                "4d",
                dict(zip(("data", "z", "y", "x"), grid, strict=True)),
                b,
                acc,
                ckpt,
                step,
                compute_s,
                rec_s,
                exposed,
                comm_s,
                0.0,
                0.0,
                mem,
                comm_model,
            ).finish(model, machine, gpus, global_batch, seq_len)
        )
    rows.sort(key=lambda r: r.step_s)
    stats["seconds"] = time.perf_counter() - t0
    return rows, stats


def _memory_line(
    model: ModelSpec,
    grid,
    seq_len: int,
    mem_bytes: float,
    ckpt: bool,
    dtype: str,
    prefetch: bool,
    sizes: list[int],
):
    """``b -> peak bytes`` of :func:`tetrad.plan.memory.tetrad` from two evaluations: every
    phase's total is affine in the micro-batch (activations, logits and recompute sets grow with
    ``m``; weights, gathered blocks and step buffers do not), so the peak is the maximum of the
    phases' lines. ``inf`` for every ``b`` when ``b = 1`` already does not fit."""
    if not sizes:
        return lambda b: float("inf")
    lo = memory.tetrad(
        model,
        grid,
        1,
        seq_len,
        mem_bytes,
        activation_checkpointing=ckpt,
        dtype=dtype,
        prefetch=prefetch,
    )
    if not lo.fits:
        return lambda b: float("inf")
    if sizes[-1] == 1:
        return lambda b: lo.total
    hi = memory.tetrad(
        model,
        grid,
        2,
        seq_len,
        mem_bytes,
        activation_checkpointing=ckpt,
        dtype=dtype,
        prefetch=prefetch,
    )
    lines = [(lo.phases[k], hi.phases[k] - lo.phases[k]) for k in lo.phases]
    return lambda b: max(a + (b - 1) * s for a, s in lines)


# =============================================================================================
# Classic (Megatron-LM) space
# =============================================================================================


def classic_memory(
    model: ModelSpec,
    tp: int,
    cp: int,
    pp: int,
    dp: int,
    micro_batch: int,
    seq_len: int,
    gpu_memory_bytes: float,
    num_microbatches: int,
    checkpointing: bool,
) -> memory.MemoryBreakdown:
    """:func:`tetrad.plan.memory.fujii2024`; with full recomputation the stored activations of a
    layer become its input, ``2 (s/c) b h / t`` bytes with sequence parallelism (Korthikanti et
    al., arXiv 2205.05198, section 4.3/Table 2 "full recompute"), plus one layer's full set while
    it is recomputed."""
    mem = memory.fujii2024(
        model,
        tp,
        cp,
        pp,
        dp,
        micro_batch,
        seq_len,
        gpu_memory_bytes,
        num_microbatches=num_microbatches,
    )
    if checkpointing:
        layer = memory.fujii_layer_activation_bytes(model, tp, cp, micro_batch, seq_len)
        factor = memory.fujii_pipeline_factor(pp, num_microbatches, 1)
        inp = 2.0 * seq_len / cp * micro_batch * model.hidden / tp
        mem.components["activations"] = model.n_layers * inp * factor + layer
    return mem


def megatron_estimate(
    model: ModelSpec,
    machine: Machine,
    tp: int,
    cp: int,
    pp: int,
    dp: int,
    micro_batch: int,
    seq_len: int,
    global_batch: int,
    checkpointing: bool,
) -> dict:
    """A Megatron-LM-style step time (seconds; bf16, sequence parallelism, 1F1B pipeline,
    distributed optimizer). Rank order TP fastest, then CP, DP, PP (Megatron's default
    ``tp-cp-ep-dp-pp``).

    - compute per micro-batch and stage: the stage's ``L/p`` layers on ``b S / c`` tokens with
      GEMMs split over TP (attention also over CP), the LM head and loss on the last stage;
    - TP (sequence parallel, Korthikanti et al. arXiv 2205.05198 section 4.2.2): per layer 2
      all-gathers + 2 reduce-scatters of ``b (S/c) h`` bf16 in forward, the same in backward
      (and again under recomputation), not overlapped;
    - CP (ring attention): ``c - 1`` exchanges of the local K and V per layer, forward (K, V) and
      backward (K, V, dK, dV), hidden behind the attention kernels;
    - PP: one activation send forward and one gradient send backward per micro-batch;
      1F1B bubble ``(p - 1)`` extra micro-batch slots (Narayanan et al., arXiv 2104.04473,
      section 2.2: bubble fraction ``(p-1)/m``);
    - DP x CP: gradient reduce-scatter (fp32) and parameter all-gather (bf16) of the stage's
      ``N/(t p)`` parameters, overlapped with the last micro-batch's backward and the first's
      forward (``--overlap-grad-reduce``, ``--overlap-param-gather``).

    Returns:
        ``step_s``, ``compute_s``, ``recompute_s``, ``exposed`` and ``comm`` per axis
        (``tp cp pp dp``), ``bubble_s``, ``grad_accum``.
    """
    net = machine.network
    peak, hbm, eff = machine.peak_flops, machine.hbm_bytes_per_s, machine.gemm_efficiency
    acc = global_batch // (dp * micro_batch)
    ls = model.n_layers // pp
    m = micro_batch * seq_len / cp
    c = 2
    gemm = 0.0
    for lin in model.linears():
        f = 2.0 * m * lin.out_features * lin.in_features * lin.count / tp
        gemm += f / (peak * eff(f))
    att = (
        attention_fwd_flops(model, micro_batch, seq_len, tp)
        / cp
        / (peak * machine.attention_efficiency)
    )
    ew = ELEMENTWISE
    act = ew["act_per_f_gpt"] if model.family == "gpt" else ew["act_per_f_llama"]
    elem = (
        m
        * (
            ew["norm_residual_per_h"] * model.hidden / tp
            + ew["rope_per_qk"] * (model.q_dim + model.kv_dim) / tp
            + act * model.ffn_hidden / tp
        )
        / hbm
    )
    layer_f = gemm + att + elem
    layer_b = 2.0 * gemm + 2.5 * att + ew["backward_factor"] * elem
    hf = 2.0 * m * model.vocab * model.hidden / tp
    head = hf / (peak * eff(hf))
    loss = (ew["loss_fwd_per_logit"] + ew["loss_bwd_per_logit"]) * m * model.vocab / tp / hbm
    t_f = ls * layer_f + head
    t_b = ls * layer_b + 2.0 * head + loss
    t_r = ls * layer_f if checkpointing else 0.0
    # per micro-batch and stage: (total, exposed) seconds per axis
    per = dict.fromkeys(CLASSIC_AXES, 0.0)
    per_exp = dict.fromkeys(CLASSIC_AXES, 0.0)
    if tp > 1:  # sequence parallelism: 2 AG + 2 RS per layer per pass, 1 pair for the head
        lt = net.link(1, tp)
        pay = m * model.hidden * c
        pair = lt.time(ALL_GATHER, pay) + lt.time(REDUCE_SCATTER, pay)
        per["tp"] = per_exp["tp"] = (ls * 2 * (2 + (1 if checkpointing else 0)) + 1) * pair
    if cp > 1:  # ring attention: c - 1 K/V exchanges per layer, hidden behind attention
        lc = net.link(tp, cp)
        kv = 2.0 * m * model.kv_dim / tp * c
        t_f_kv, t_b_kv = lc.time(ALL_GATHER, kv * cp), lc.time(ALL_GATHER, 2 * kv * cp)
        n_f = 2 if checkpointing else 1
        per["cp"] = ls * (n_f * t_f_kv + t_b_kv)
        per_exp["cp"] = ls * (n_f * max(0.0, t_f_kv - att) + max(0.0, t_b_kv - 2.5 * att))
    if pp > 1:  # one activation forward, one gradient backward
        lp = net.link(tp * cp * dp, 2)
        per["pp"] = per_exp["pp"] = 2.0 * (
            lp.base_latency + m * model.hidden / tp * c / lp.bandwidth
        )
    per_mb = t_f + t_b + t_r + sum(per_exp.values())
    bubble = (pp - 1) * per_mb
    comm = {a: acc * v for a, v in per.items()}
    exposed = {a: acc * v for a, v in per_exp.items()}
    # DP x CP distributed optimizer: the stage's parameters, fp32 gradients, bf16 parameters
    n_local = (
        model.n_layers * model.params_per_layer() / pp
        + max(model.embedding_params(), model.lm_head_params())
    ) / tp
    groups = dp * cp
    if groups > 1:
        ldp = net.link(tp, groups)
        t_rs = ldp.time(REDUCE_SCATTER, n_local * 4)
        t_ag = ldp.time(ALL_GATHER, n_local * 2)
        comm["dp"] = t_rs + t_ag
        exposed["dp"] = max(0.0, t_rs - t_b) + max(0.0, t_ag - t_f)
    opt = ew["optimizer_per_param"] * n_local / groups / hbm
    compute = acc * (t_f + t_b + t_r) + opt
    step = compute + sum(exposed.values()) + bubble
    return {
        "step_s": step,
        "compute_s": compute,
        "recompute_s": acc * t_r,
        "exposed": exposed,
        "comm": comm,
        "bubble_s": bubble,
        "grad_accum": acc,
    }


def search_classic(
    model: ModelSpec,
    machine: Machine,
    gpus: int,
    global_batch: int,
    seq_len: int,
    *,
    top: int = 10,
    checkpointing: tuple[bool, ...] = (False, True),
    micro_batches: tuple[int, ...] | None = None,
    gpu_memory_bytes: float | None = None,
) -> tuple[list[Row], dict]:
    """The ``top`` fastest fitting Megatron-style configurations (empty if none fits)."""
    _check_inputs(model, gpus, global_batch, seq_len)
    t0 = time.perf_counter()
    mem_bytes = float(gpu_memory_bytes or machine.memory_bytes)
    allowed = set(micro_batches) if micro_batches else None
    gpn = machine.gpus_per_node
    stats = {"configs": 0, "fitting": 0}
    rows: list[Row] = []
    for tp in divisors(gpus):
        if (
            tp > gpn
            or model.n_heads % tp
            or model.n_kv_heads % tp
            or model.ffn_hidden % tp
            or model.hidden % tp
        ):
            continue
        for cp in divisors(gpus // tp):
            if tp * cp > gpn or seq_len % (2 * cp) and cp > 1:
                continue
            for pp in divisors(gpus // (tp * cp)):
                if model.n_layers % pp:
                    continue
                dp = gpus // (tp * cp * pp)
                if global_batch % dp:
                    continue
                for ckpt in checkpointing:
                    for b in divisors(global_batch // dp):
                        if allowed is not None and b not in allowed:
                            continue
                        stats["configs"] += 1
                        acc = global_batch // (dp * b)
                        mem = classic_memory(
                            model, tp, cp, pp, dp, b, seq_len, mem_bytes, acc, ckpt
                        )
                        if not mem.fits:
                            break
                        stats["fitting"] += 1
                        est = megatron_estimate(
                            model, machine, tp, cp, pp, dp, b, seq_len, global_batch, ckpt
                        )
                        step = est["step_s"]
                        rows.append(
                            Row(
                                "classic",
                                {"tp": tp, "cp": cp, "pp": pp, "dp": dp},
                                b,
                                acc,
                                ckpt,
                                step,
                                est["compute_s"],
                                est["recompute_s"],
                                est["exposed"],
                                est["comm"],
                                0.0,
                                0.0,
                                mem,
                                "megatron",
                                {"pipeline_bubble": est["bubble_s"]},
                            ).finish(model, machine, gpus, global_batch, seq_len)
                        )
    rows.sort(key=lambda r: r.step_s)
    stats["seconds"] = time.perf_counter() - t0
    return rows[:top], stats


def plan(
    model: ModelSpec,
    machine: Machine,
    gpus: int,
    global_batch: int,
    seq_len: int,
    *,
    top: int = 10,
    checkpointing: tuple[bool, ...] = (False, True),
    micro_batches: tuple[int, ...] | None = None,
    overlaps="all",
    comm_model: str = "tetrad",
    classic: bool = True,
    dtype: str = "bf16",
    gpu_memory_bytes: float | None = None,
) -> SearchResult:
    """Both searches; see :func:`search_4d` and :func:`search_classic`.

    Raises:
        PlanError: bad inputs, or no 4D configuration at all (message says what to change).
    """
    t0 = time.perf_counter()
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
        )
    inputs = {
        "model": model.name,
        "model_summary": model.summary(),
        "machine": machine.name,
        "machine_summary": machine.summary(),
        "gpus": gpus,
        "global_batch": global_batch,
        "seq_len": seq_len,
        "overlaps": sorted(
            Context(model, machine, seq_len, global_batch, overlaps=overlaps).overlaps
        ),
        "comm_model": comm_model,
        "dtype": dtype,
        "gpu_memory_gib": (gpu_memory_bytes or machine.memory_bytes) / GiB,
    }
    all_stats = {"four_d": stats, "classic": cstats, "seconds": time.perf_counter() - t0}
    return SearchResult(rows, crow, all_stats, inputs)
