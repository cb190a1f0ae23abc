"""The classic Megatron-LM space (TP, CP, PP, DP) beside the 4D one, for comparison.

``TP * PP * CP * DP = GPUs`` with ``TP * CP <= GPUs per node`` (Fujii et al.'s search,
arXiv 2411.06465, ``optimal_setting_search.py``), ``TP`` dividing heads, KV heads, the FFN and
the hidden size, ``PP`` dividing the layers, ``S % (2 CP) == 0``; memory from
:func:`tetrad.plan.memory.fujii.fujii2024` (:func:`classic_memory` adds full recomputation); time
from :func:`megatron_estimate`.

Checkpointing: ``none`` and ``full`` as Megatron-LM runs them. Megatron's ``selective``
recomputes the attention core (Korthikanti et al., arXiv 2205.05198, section 5), whose ``S^2``
tensors FlashAttention never stores, and Fujii et al.'s formulas already assume FlashAttention:
it is the same memory and time as ``none``, so the search tries it only when ``none`` is not
asked for.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

from tetrad.plan.compute.elementwise import ELEMENTWISE
from tetrad.plan.compute.flops import attention_fwd_flops
from tetrad.plan.machine.description import Machine
from tetrad.plan.machine.network import ALL_GATHER, REDUCE_SCATTER
from tetrad.plan.memory import fujii
from tetrad.plan.memory.breakdown import MemoryBreakdown
from tetrad.plan.search.rows import CLASSIC_AXES, Row
from tetrad.plan.search.space import check_inputs, checkpointing_modes, divisors
from tetrad.spec.activation_checkpointing import CHECKPOINTING, parse_checkpointing
from tetrad.spec.model import ModelSpec
from tetrad.spec.sharding import context_problems, tp_problems


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
    checkpointing: str | bool,
    virtual_pp: int = 1,
    stage_layers: tuple[int, ...] = (),
) -> MemoryBreakdown:
    """:func:`tetrad.plan.memory.fujii.fujii2024`; with full recomputation the stored activations of
    a layer become its input, ``2 (s/c) b h / t`` bytes with sequence parallelism (Korthikanti et
    al., arXiv 2205.05198, section 4.3/Table 2 "full recompute"), plus one layer's full set while
    it is recomputed. ``checkpointing``: ``none``, ``selective`` (as ``none``, module doc) or
    ``full`` (a bool: ``full``/``none``). ``virtual_pp``: interleaved 1F1B's chunks per rank
    (Fujii's factor ``1 + (p-1)/(p v)``). ``stage_layers``: an uneven split (Megatron-Core's
    first/last-stage layer counts), estimated as the even split of ``p`` times its largest
    stage (an upper bound: the first stage holds at most that many layers)."""
    if stage_layers and model.n_layers % pp:
        model = dataclasses.replace(model, n_layers=pp * max(stage_layers))
    mem = fujii.fujii2024(
        model,
        tp,
        cp,
        pp,
        dp,
        micro_batch,
        seq_len,
        gpu_memory_bytes,
        num_microbatches=num_microbatches,
        virtual_pp=virtual_pp,
    )
    if parse_checkpointing(checkpointing) == "full":
        layer = fujii.fujii_layer_activation_bytes(model, tp, cp, micro_batch, seq_len)
        factor = fujii.fujii_pipeline_factor(pp, num_microbatches, virtual_pp)
        inp = 2.0 * seq_len / cp * micro_batch * model.dim / tp
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
    checkpointing: str | bool,
    virtual_pp: int = 1,
    stage_layers: tuple[int, ...] = (),
) -> dict:
    """A Megatron-LM-style step time (seconds; bf16, sequence parallelism, 1F1B pipeline,
    distributed optimizer). Rank order TP fastest, then CP, DP, PP (Megatron's default
    ``tp-cp-ep-dp-pp``).

    - compute per micro-batch and stage: the stage's ``L/p`` layers on ``b S / c`` tokens with
      GEMMs split over TP (attention also over CP), the LM head, loss and final norm on the
      last stage, the word embedding on the first (its backward forms a dense ``[V/TP, h]``
      gradient that is added into the fp32 main gradient: 12 bytes per element per
      micro-batch);
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

    ``checkpointing``: ``full`` recomputes each layer's forward and its TP and CP collectives;
    ``none`` and ``selective`` (module doc) recompute nothing.

    Returns:
        ``step_s``, ``compute_s``, ``recompute_s``, ``exposed`` and ``comm`` per axis
        (``tp cp pp dp``), ``bubble_s``, ``grad_accum``.
    """
    full = parse_checkpointing(checkpointing) == "full"
    net = machine.network
    peak, hbm, eff = machine.peak_flops, machine.hbm_bytes_per_s, machine.gemm_efficiency
    acc = global_batch // (dp * micro_batch)
    ls = max(stage_layers) if stage_layers else model.n_layers // pp
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
            ew["norm_residual_per_h"] * model.dim / tp
            + ew["rope_per_qk"] * (model.q_dim + model.kv_dim) / tp
            + act * model.ffn_dim / tp
        )
        / hbm
    )
    layer_f = gemm + att + elem
    layer_b = 2.0 * gemm + 2.5 * att + ew["backward_factor"] * elem
    hf = 2.0 * m * model.vocab_size * model.dim / tp
    head = hf / (peak * eff(hf))
    # Megatron's unfused vocabulary-parallel cross-entropy moves about the bytes of tetrad's
    # fused one (softmax forward, gradient in backward)
    loss = ew["loss_fwd_per_logit"] * m * model.vocab_size / tp / hbm
    # The word embedding on the first stage: the lookup, and in backward torch's dense
    # gradient of the [V/TP, h] table (bf16, zeroed: 2 B per element) that Megatron-LM's DDP
    # hook adds into the fp32 main gradient (read 2 + 4, write 4) every micro-batch (the
    # embedding has no gradient-accumulation fusion: megatron/core/distributed/
    # distributed_data_parallel.py, _make_backward_post_hook); the final norm on the last.
    emb_f = 8.0 * m * model.dim / tp / hbm
    emb_b = emb_f + 12.0 * model.embedding_params() / tp / hbm
    norm = 0.25 * ew["norm_residual_per_h"] * m * model.dim / tp / hbm
    last_f, last_b = head + norm, 2.0 * head + loss + ew["backward_factor"] * norm
    if pp == 1:
        t_f = ls * layer_f + emb_f + last_f
        t_b = ls * layer_b + emb_b + last_b
    elif stage_layers:  # the slowest stage: the first with the embedding, the last the head
        f = [n * layer_f for n in stage_layers]
        b = [n * layer_b for n in stage_layers]
        f[0], b[0] = f[0] + emb_f, b[0] + emb_b
        f[-1], b[-1] = f[-1] + last_f, b[-1] + last_b
        t_f, t_b = max(f), max(b)
    else:  # equal stages: the last, with the head, is the slowest
        t_f = ls * layer_f + last_f
        t_b = ls * layer_b + last_b
    t_r = ls * layer_f if full else 0.0
    # per micro-batch and stage: (total, exposed) seconds per axis
    per = dict.fromkeys(CLASSIC_AXES, 0.0)
    per_exp = dict.fromkeys(CLASSIC_AXES, 0.0)
    if tp > 1:  # sequence parallelism: 2 AG + 2 RS per layer per pass, 1 pair for the head
        lt = net.link(1, tp)
        pay = m * model.dim * c
        pair = lt.time(ALL_GATHER, pay) + lt.time(REDUCE_SCATTER, pay)
        per["tp"] = per_exp["tp"] = (ls * 2 * (2 + (1 if full else 0)) + 1) * pair
    if cp > 1:  # ring attention: c - 1 K/V exchanges per layer, hidden behind attention
        lc = net.link(tp, cp)
        kv = 2.0 * m * model.kv_dim / tp * c
        t_f_kv, t_b_kv = lc.time(ALL_GATHER, kv * cp), lc.time(ALL_GATHER, 2 * kv * cp)
        n_f = 2 if full else 1
        per["cp"] = ls * (n_f * t_f_kv + t_b_kv)
        per_exp["cp"] = ls * (n_f * max(0.0, t_f_kv - att) + max(0.0, t_b_kv - 2.5 * att))
    if pp > 1:  # one activation forward, one gradient backward
        lp = net.link(tp * cp * dp, 2)
        per["pp"] = per_exp["pp"] = (
            2.0 * virtual_pp * (lp.base_latency + m * model.dim / tp * c / lp.bandwidth)
        )
    per_mb = t_f + t_b + t_r + sum(per_exp.values())
    bubble = (pp - 1) * per_mb / virtual_pp
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


VIRTUAL_CHOICES = (2, 3, 4, 5, 6, 8)
"""Virtual stages per rank the classic space tries (NVIDIA's Llama-3 recipes: VP 5 and 8)."""


def uneven_split(n_layers: int, pp: int) -> tuple[int, ...]:
    """Megatron-Core's uneven split of ``L`` layers over ``p`` stages
    (``--decoder-first-pipeline-num-layers``, ``--decoder-last-pipeline-num-layers``): the
    ``p - 2`` middle stages get the same ``n`` layers, the smallest with ``2 <= L - (p - 2) n <=
    2 n``; the first and the last share the rest, the last (with the LM head) the fewer. Two
    stages: ``ceil(L/2)`` and ``floor(L/2)``. Empty when there is no such ``n`` (every stage
    needs a layer)."""
    if pp == 1:
        return (n_layers,)
    if pp == 2:
        return (n_layers - n_layers // 2, n_layers // 2)
    n = -(-n_layers // pp)
    while n_layers - (pp - 2) * n > 2 * n:
        n += 1
    rest = n_layers - (pp - 2) * n
    if rest < 2:
        return ()
    return (rest - rest // 2, *([n] * (pp - 2)), rest // 2)


def pipeline_variants(
    n_layers: int, pp: int, interleave: bool, uneven: bool
) -> list[tuple[int, tuple[int, ...]]]:
    """``(virtual stages, stage layers)`` the classic space tries for ``p = pp``: the even split
    (``()``) when ``p`` divides the layers, else :func:`uneven_split` (with ``uneven``); and
    interleaved 1F1B with ``v`` of :data:`VIRTUAL_CHOICES` where ``p v`` divides the layers
    (with ``interleave``; Megatron's ``--num-layers-per-virtual-pipeline-stage``)."""
    out: list[tuple[int, tuple[int, ...]]] = []
    if n_layers % pp == 0:
        out.append((1, ()))
    elif uneven and pp <= n_layers and (layers := uneven_split(n_layers, pp)):
        out.append((1, layers))
    if interleave and pp > 1:
        out += [(v, ()) for v in VIRTUAL_CHOICES if n_layers % (pp * v) == 0]
    return out


def _classic_grids(
    model: ModelSpec,
    gpus: int,
    gpus_per_node: int,
    global_batch: int,
    seq_len: int,
    uneven: bool = True,
) -> Iterator[tuple[int, int, int, int]]:
    """Every ``(TP, CP, PP, DP)`` of the classic space (module doc), TP outermost."""
    for tp in divisors(gpus):
        if tp > gpus_per_node or tp_problems(model, tp):
            continue
        for cp in divisors(gpus // tp):
            if tp * cp > gpus_per_node or context_problems(seq_len, cp):
                continue
            for pp in divisors(gpus // (tp * cp)):
                if model.n_layers % pp and not (uneven and pp <= model.n_layers):
                    continue
                dp = gpus // (tp * cp * pp)
                if global_batch % dp:
                    continue
                yield tp, cp, pp, dp


def search_classic(
    model: ModelSpec,
    machine: Machine,
    gpus: int,
    global_batch: int,
    seq_len: int,
    *,
    top: int = 10,
    checkpointing: tuple[str | bool, ...] = CHECKPOINTING,
    micro_batches: tuple[int, ...] | None = None,
    gpu_memory_bytes: float | None = None,
    pipeline: bool = True,
) -> tuple[list[Row], dict]:
    """The ``top`` fastest fitting Megatron-style configurations (empty if none fits), step
    seconds from :func:`megatron_estimate`, and counts (``configs``, ``fitting``, ``seconds``).
    For each grid and checkpointing mode (``selective`` only without ``none``: module doc),
    micro-batches ascend until one does not fit. ``pipeline``: also interleaved 1F1B and
    uneven splits (:func:`pipeline_variants`; without it, 1F1B on even splits only).

    Raises:
        PlanError: bad inputs.
        tetrad.spec.activation_checkpointing.CheckpointingError: an unknown mode.
    """
    check_inputs(model, gpus, global_batch, seq_len)
    t0 = time.perf_counter()
    mem_bytes = float(gpu_memory_bytes or machine.memory_bytes)
    allowed = set(micro_batches) if micro_batches else None
    stats = {"configs": 0, "fitting": 0}
    modes = checkpointing_modes(checkpointing)
    if "none" in modes:
        modes = tuple(c for c in modes if c != "selective")
    rows: list[Row] = []
    grids = _classic_grids(
        model, gpus, machine.gpus_per_node, global_batch, seq_len, uneven=pipeline
    )
    for tp, cp, pp, dp in grids:
        for ckpt in modes:
            for v, layers in pipeline_variants(model.n_layers, pp, pipeline, pipeline):
                rows += _classic_rows(
                    model,
                    machine,
                    (tp, cp, pp, dp),
                    ckpt,
                    v,
                    layers,
                    global_batch,
                    seq_len,
                    mem_bytes,
                    allowed,
                    stats,
                    gpus,
                )
    rows.sort(key=lambda r: r.step_s)
    stats["seconds"] = time.perf_counter() - t0
    return rows[:top], stats


def _classic_rows(
    model, machine, sizes, ckpt, v, layers, global_batch, seq_len, mem_bytes, allowed, stats, gpus
) -> list[Row]:
    """The fitting rows of one grid, mode and pipeline variant, micro-batches ascending until
    one does not fit (interleaving: only where ``m % PP == 0``, Megatron's rule)."""
    tp, cp, pp, dp = sizes
    out = []
    for b in divisors(global_batch // dp):
        if allowed is not None and b not in allowed:
            continue
        acc = global_batch // (dp * b)
        if v > 1 and acc % pp:
            continue
        stats["configs"] += 1
        mem = classic_memory(model, tp, cp, pp, dp, b, seq_len, mem_bytes, acc, ckpt, v, layers)
        if not mem.fits:
            break
        stats["fitting"] += 1
        est = megatron_estimate(
            model, machine, tp, cp, pp, dp, b, seq_len, global_batch, ckpt, v, layers
        )
        other = {"pipeline_bubble": est["bubble_s"]}
        if layers:
            other["stage_layers"] = list(layers)
        out.append(
            Row(
                "classic",
                {"tp": tp, "cp": cp, "pp": pp, "dp": dp},
                b,
                acc,
                ckpt,
                est["step_s"],
                est["compute_s"],
                est["recompute_s"],
                est["exposed"],
                est["comm"],
                0.0,
                0.0,
                mem,
                "megatron",
                other,
                virtual_stages=v,
                schedule="interleaved-1f1b" if v > 1 else "",
            ).finish(model, machine, gpus, global_batch, seq_len)
        )
    return out
