"""Communication model of the 4D algorithm: every collective of one optimizer step, its bytes, its
time on the network, and how much of it the runtime's overlap schedule hides.

Two modes.

``tetrad`` (:func:`estimate`, :func:`collectives`) predicts exactly the collectives tetrad's
runtime issues (tetrad/parallel/{linear,embedding,norm,loss,grads,overlap}.py,
tetrad/train/step.py). Per micro-batch, ``m = micro_batch * seq_len`` tokens per rank, compute
dtype ``c`` bytes (2 for bf16 on GPU, 4 on CPU), gradients fp32. For a Linear ``[n, k]`` with input
axis ``I`` and output axis ``O`` (X and Y; swapped when transposed):

    forward   all-gather_Z   W shard cast to c          output  n k / (G_x G_y) * c
              all-reduce_I   y                          m n / G_O * c
    backward  all-gather_Z   W again                    n k / (G_x G_y) * c
              all-reduce_O   dx                         m k / G_I * c
              reduce-scatter_Z dW (fp32)                input   n k / (G_x G_y) * 4
    embedding all-gather_Z   V h / (G_y G_x) * 4 (fp32, no cast); all-reduce_Y m h / G_x * 4;
              backward reduce-scatter_Z V h / (G_y G_x) * 4
    RMSNorm   all-reduce_X   m * 4 forward and backward (2 per block + the final one)
    loss      3 all-reduce_Y m * 4 (max, sum of exp, target logit), forward only
    recompute (activation checkpointing) a block's forward collectives once more in backward
    step      all-reduce_data of the Z-sharded weight gradients (sum of local shards, fp32);
              norm-weight gradients all-reduce_Z then all-reduce_data; the loss scalar (4 B)
              over Z and data; the gradient-norm scalar (8 B, float64) over the world.

A size-1 axis issues nothing. Times come from the alpha-beta ring model of
:mod:`tetrad.plan.network` with each axis's placement.

Overlap (the runtime's :mod:`tetrad.parallel.overlap`, names :data:`OVERLAPS`; ``none`` exposes
everything). Collectives on one axis share one communicator, hence one stream, and run in issue
order; collectives on different axes run concurrently (link contention between axes is not
modelled). Steady state, every block alike:

- ``prefetch``: the Z all-gather of the next weight in execution order (forward, recompute and
  backward) runs during the current layer's window (its GEMMs and the element-wise work up to the
  next Linear). A window's Z queue holds the reduce-scatter issued at the end of the previous
  window (when ``reduce_scatter`` is on) and then the prefetch; the compute stalls by
  ``max(0, rs + ag - window)``. Without prefetch the all-gather is blocking and waits behind the
  queued reduce-scatter, so both are exposed. The first weight of a micro-batch (the embedding) is
  never prefetched.
- ``reduce_scatter``: the dW reduce-scatter is asynchronous (as above); those still pending at the
  end of the micro-batch's backward are exposed.
- ``dx_all_reduce``: the backward dx all-reduce runs during the dW GEMM: exposed
  ``max(0, t - dW)``.
- ``domino``: the forward all-reduce of a Linear's output is split in two halves (when ``m >= 2 *
  domino_min_rows``); the first half's all-reduce runs during the second half's GEMM: exposed
  ``t_2 + max(0, t_1 - GEMM/2)``.
- ``dp_all_reduce``: in the last micro-batch the weight gradients are all-reduced over data in
  buckets (``bucket_bytes``) as the reduce-scatters complete; a block's buckets run during the
  backward (and recompute) of the block below; the queue carries over; what is left when the
  backward ends is exposed.
- always exposed: norm, embedding and loss all-reduces, the step-level collectives.

``axonn`` (:func:`axonn_comm`) reproduces AxoNN's published model (Megatron-AxoNN
``examples/comm_model.py``, ``model_v2``; Singh et al., arXiv 2305.13525): per block Linear,
volume terms in bf16 elements, GiB over the measured bandwidth, summed, no latency, no overlap,
no embedding, head, norms or loss. Where it deviates from the true layout, see :func:`axonn_comm`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from tetrad.plan.compute import ELEMENTWISE, BlockCompute, block_compute
from tetrad.plan.machines import Machine
from tetrad.plan.models import ModelSpec, PlanError
from tetrad.plan.network import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, ring_bytes
from tetrad.spec import (
    COMM_AXES,
    DOMINO_MIN_ROWS,
    DP_BUCKET_BYTES,
    GiB,
    OverlapError,
    parse_overlaps,
)

FP32 = 4


@dataclass(frozen=True)
class Collective:
    """One kind of collective of an optimizer step on one rank.

    Attributes:
        layer: ``wq`` ... (block Linears, all blocks together), ``output`` (LM head),
            ``embedding``, ``positions`` (GPT), ``norm``, ``loss``, ``gradients``,
            ``norm_gradients``, ``loss_scalar``, ``grad_norm``; a Domino half is
            ``wq (half 1)``.
        phase: ``forward``, ``recompute``, ``backward`` or ``step``.
        axis: ``x``, ``y``, ``z``, ``data`` or ``world``.
        kind: ``all_reduce``, ``all_gather`` or ``reduce_scatter``.
        payload_bytes: buffer bytes of one call (all-gather: output; reduce-scatter: input).
        calls: calls per optimizer step.
        ring_bytes: bytes one rank sends per call (ring algorithm).
        time_s: seconds per call (alpha-beta, this axis's placement).
        hidden_behind: the compute it overlaps, empty when blocking.
        exposed_s: seconds per optimizer step the compute waits for it (all calls).
    """

    layer: str
    phase: str
    axis: str
    kind: str
    payload_bytes: float
    calls: int
    ring_bytes: float
    time_s: float
    hidden_behind: str
    exposed_s: float

    @property
    def total_s(self) -> float:
        """Seconds of all calls of the step."""
        return self.calls * self.time_s

    def to_dict(self) -> dict:
        return {**asdict(self), "total_s": self.total_s}


@dataclass(frozen=True)
class Estimate:
    """Predicted time of one optimizer step on one rank (seconds).

    Attributes:
        step_s: step time.
        compute_s: compute (GEMMs, attention, element-wise, optimizer), all micro-batches.
        recompute_s: of which activation recomputation.
        exposed_s: exposed communication per axis.
        comm_s: all communication per axis (exposed + hidden).
        grad_accum: micro-batches per step.
        collectives: per-collective detail (only from :func:`collectives`).
    """

    step_s: float
    compute_s: float
    recompute_s: float
    exposed_s: dict
    comm_s: dict
    grad_accum: int
    collectives: tuple = ()


class Context:
    """Per (model, machine, settings) constants of :func:`estimate`, computed once per search.

    Args:
        compute_bytes: 2 (bf16, the runtime on GPU) or 4 (fp32, on CPU).
        overlaps: names from :data:`OVERLAPS` (or "all"/"none").
        gemm_efficiency: optional constant fraction of peak for every GEMM.
    """

    def __init__(
        self,
        model: ModelSpec,
        machine: Machine,
        seq_len: int,
        global_batch: int,
        *,
        overlaps: str | Iterable[str] = "all",
        compute_bytes: int = 2,
        bucket_bytes: int = DP_BUCKET_BYTES,
        domino_min_rows: int = DOMINO_MIN_ROWS,
    ):
        if compute_bytes not in (2, 4):
            raise PlanError(f"compute_bytes={compute_bytes}: use 2 (bf16) or 4 (fp32)")
        self.model, self.machine = model, machine
        self.seq_len, self.global_batch = seq_len, global_batch
        try:
            self.overlaps = parse_overlaps(overlaps)
        except OverlapError as e:
            raise PlanError(str(e)) from None
        self.c = compute_bytes
        self.bucket_bytes, self.domino_min_rows = bucket_bytes, domino_min_rows
        self.linears = model.linears()
        # (name, n*k*count, n, k, transposed, bias elements n*count)
        self.lin = tuple(
            (
                lin.name,
                lin.weight_elements * lin.count,
                lin.out_features,
                lin.in_features,
                lin.transposed,
                lin.count,
                lin.out_features * lin.count if lin.bias else 0,
            )
            for lin in self.linears
        )
        self.head_nk = model.vocab * model.hidden
        self.gpt = model.family == "gpt"
        self._buckets: dict = {}
        self._compute: dict = {}

    def compute(self, grid, micro_batch: int) -> BlockCompute:
        """Compute times (cached per ``(G_y, G_x, micro_batch)``; the optimizer term is left to
        :func:`estimate`, it depends on ``G_z``)."""
        key = (grid[2], grid[3], micro_batch)
        got = self._compute.get(key)
        if got is None:
            got = block_compute(
                self.model, self.machine, grid, micro_batch, self.seq_len, linears=self.linears
            )
            self._compute[key] = got
        return got

    def weight_shards(self, gx: int, gy: int, gz: int) -> tuple[list[float], float, float, float]:
        """Local weight-shard elements in backward (gradient-ready) order and totals:
        ``(order, block_elements, head_elements, embedding_elements)``."""
        shard = gx * gy * gz
        block = [nk / shard for (_, nk, *_rest) in reversed(self.lin)]
        head = self.head_nk / shard
        emb = (self.model.vocab + self.model.max_positions) * self.model.hidden / shard
        return block, sum(block), head, emb

    def bucket_calls(self, gx: int, gy: int, gz: int) -> int:
        """Data-parallel all-reduce calls of the bucketed overlap (the runtime's rule: append
        each gradient as it becomes ready, launch when the bucket reaches ``bucket_bytes``,
        launch the rest at the end)."""
        key = (gx, gy, gz)
        got = self._buckets.get(key)
        if got is None:
            block, _, head, emb = self.weight_shards(gx, gy, gz)
            sizes = [head] + block * self.model.n_layers + [emb]
            if min(sizes) * FP32 >= self.bucket_bytes:
                got = len(sizes)
            else:
                got, acc = 0, 0.0
                for s in sizes:
                    acc += s * FP32
                    if acc >= self.bucket_bytes:
                        got, acc = got + 1, 0.0
                got += acc > 0
            self._buckets[key] = got
        return got

    def vector_elements(self, gx: int, gy: int) -> float:
        """Local elements of the parameters replicated over Z (norm weights; GPT: LayerNorm
        biases and Linear biases): their gradients are all-reduced over Z and data."""
        norm = self.model.norm_params() / gx
        bias = sum(b / (gx if t else gy) for (_, _, _, _, t, _, b) in self.lin)
        return self.model.n_layers * (2 * norm + bias) + norm


def _max0(v: float) -> float:
    return v if v > 0.0 else 0.0


def estimate(
    ctx: Context,
    grid: tuple[int, int, int, int],
    micro_batch: int,
    checkpointing: bool,
    *,
    detail: bool = False,
) -> Estimate:
    """Predicted step time of ``grid = (G_data, G_z, G_y, G_x)`` (see the module doc).

    Args:
        micro_batch: samples per micro-batch of one (data, z) cell.
        checkpointing: activation checkpointing of every block.
        detail: also return the per-collective list (slower; for reports and benchmarks).

    Raises:
        PlanError: the global batch does not split into micro-batches on this grid.
    """
    gd, gz, gy, gx = grid
    cells = gd * gz * micro_batch
    if ctx.global_batch % cells:
        raise PlanError(
            f"global batch {ctx.global_batch} is not divisible by G_data*G_z*"
            f"micro_batch = {gd}*{gz}*{micro_batch}: change the batch or the grid"
        )
    acc = ctx.global_batch // cells
    model, net = ctx.model, ctx.machine.network
    L, c, m = model.n_layers, ctx.c, micro_batch * ctx.seq_len
    ov = ctx.overlaps
    pre, rsa, dxo = "prefetch" in ov, "reduce_scatter" in ov, "dx_all_reduce" in ov
    dom = "domino" in ov and m >= 2 * ctx.domino_min_rows
    sizes = {"x": gx, "y": gy, "z": gz, "data": gd}
    links = net.grid_links(grid)
    lz, ld = links["z"], links["data"]
    _, block_el, head_el, emb_el = ctx.weight_shards(gx, gy, gz)
    vec_el = ctx.vector_elements(gx, gy)
    local = L * block_el + head_el + emb_el + vec_el
    comp = ctx.compute(grid, micro_batch)
    optimizer = ELEMENTWISE["optimizer_per_param"] * local / ctx.machine.hbm_bytes_per_s
    n = len(ctx.lin)
    rec: dict | None = {} if detail else None
    exposed = dict.fromkeys(COMM_AXES, 0.0)
    total = dict.fromkeys(COMM_AXES, 0.0)
    ckr = 1 if checkpointing else 0

    def add(layer, phase, axis, kind, payload, calls, t, exp, hidden=""):
        """Record ``calls`` per step of one collective and ``exp`` exposed seconds per step."""
        total[axis] += calls * t
        exposed[axis] += exp
        if rec is not None and calls:
            key = (layer, phase, axis, kind)
            old = rec.get(key)
            if old is None:
                rec[key] = [payload, calls, t, hidden, exp]
            else:
                old[1] += calls
                old[4] += exp

    # ---- per block Linear: X/Y all-reduces ---------------------------------------------------
    t_ag, t_rs, names = [0.0] * n, [0.0] * n, []
    xy = gx * gy
    for i, (name, nk, nout, kin, tr, cnt, _) in enumerate(ctx.lin):
        names.append(name)
        in_ax, out_ax = ("y", "x") if tr else ("x", "y")
        g_in, g_out = sizes[in_ax], sizes[out_ax]
        gemm = comp.gemm[i]
        if gz > 1:
            t_ag[i] = lz.time(ALL_GATHER, nk / xy * c)
            t_rs[i] = lz.time(REDUCE_SCATTER, nk / xy * FP32)
        calls_f = L * acc * cnt
        if g_in > 1:
            li = links[in_ax]
            if dom:
                r1 = m // 2
                p1, p2 = r1 * nout / g_out * c, (m - r1) * nout / g_out * c
                t1, t2 = li.time(ALL_REDUCE, p1), li.time(ALL_REDUCE, p2)
                e1 = _max0(t1 - gemm * (m - r1) / m)
                for phase, k in (("forward", 1), ("recompute", ckr)):
                    if k:
                        add(
                            f"{name} (half 1)",
                            phase,
                            in_ax,
                            ALL_REDUCE,
                            p1,
                            calls_f,
                            t1,
                            calls_f * e1,
                            "second-half GEMM (Domino)",
                        )
                        add(
                            f"{name} (half 2)",
                            phase,
                            in_ax,
                            ALL_REDUCE,
                            p2,
                            calls_f,
                            t2,
                            calls_f * t2,
                        )
            else:
                p = m * nout / g_out * c
                t = li.time(ALL_REDUCE, p)
                add(name, "forward", in_ax, ALL_REDUCE, p, calls_f, t, calls_f * t)
                if ckr:
                    add(name, "recompute", in_ax, ALL_REDUCE, p, calls_f, t, calls_f * t)
        if g_out > 1:
            p = m * kin / g_in * c
            t = links[out_ax].time(ALL_REDUCE, p)
            e = _max0(t - gemm) if dxo else t
            add(
                name,
                "backward",
                out_ax,
                ALL_REDUCE,
                p,
                calls_f,
                t,
                calls_f * e,
                "dW GEMM" if dxo else "",
            )

    # ---- LM head (non-transposed: in X, out Y), loss, norms, embedding -----------------------
    hk, hv = model.hidden, model.vocab
    t_ag_h = lz.time(ALL_GATHER, hk * hv / xy * c) if gz > 1 else 0.0
    t_rs_h = lz.time(REDUCE_SCATTER, hk * hv / xy * FP32) if gz > 1 else 0.0
    if gx > 1:
        if dom:
            r1 = m // 2
            p1, p2 = r1 * hv / gy * c, (m - r1) * hv / gy * c
            t1, t2 = links["x"].time(ALL_REDUCE, p1), links["x"].time(ALL_REDUCE, p2)
            e1 = _max0(t1 - comp.head * (m - r1) / m)
            add(
                "output (half 1)",
                "forward",
                "x",
                ALL_REDUCE,
                p1,
                acc,
                t1,
                acc * e1,
                "second-half GEMM (Domino)",
            )
            add("output (half 2)", "forward", "x", ALL_REDUCE, p2, acc, t2, acc * t2)
        else:
            p = m * hv / gy * c
            t = links["x"].time(ALL_REDUCE, p)
            add("output", "forward", "x", ALL_REDUCE, p, acc, t, acc * t)
    if gy > 1:
        p = m * hk / gx * c
        t = links["y"].time(ALL_REDUCE, p)
        add(
            "output",
            "backward",
            "y",
            ALL_REDUCE,
            p,
            acc,
            t,
            acc * (_max0(t - comp.head) if dxo else t),
            "dW GEMM" if dxo else "",
        )
        p = m * FP32
        t = links["y"].time(ALL_REDUCE, p)
        add("loss", "forward", "y", ALL_REDUCE, p, 3 * acc, t, 3 * acc * t)
        p = m * hk / gx * FP32
        t = links["y"].time(ALL_REDUCE, p)
        n_tab = 2 if model.max_positions else 1
        add("embedding", "forward", "y", ALL_REDUCE, p, acc, t, acc * t)
        if n_tab == 2:
            add("positions", "forward", "y", ALL_REDUCE, p, acc, t, acc * t)
    if gx > 1:
        p = m * FP32 * (2 if ctx.gpt else 1)
        t = links["x"].time(ALL_REDUCE, p)
        nf = (2 * L + 1) * acc
        add("norm", "forward", "x", ALL_REDUCE, p, nf, t, nf * t)
        if ckr:
            add("norm", "recompute", "x", ALL_REDUCE, p, 2 * L * acc, t, 2 * L * acc * t)
        add("norm", "backward", "x", ALL_REDUCE, p, nf, t, nf * t)

    # ---- Z: weight all-gathers and reduce-scatters through the windows ----------------------
    if gz > 1:
        _z_windows(
            ctx,
            comp,
            names,
            t_ag,
            t_rs,
            t_ag_h,
            t_rs_h,
            acc,
            checkpointing,
            pre,
            rsa,
            add,
            lz,
            xy,
            c,
        )

    # ---- data: weight gradients -------------------------------------------------------------
    fwd_mb, bwd_mb, rec_mb = comp.micro_batch_seconds(L, checkpointing)
    w_total = (L * block_el + head_el + emb_el) * FP32
    if gd > 1:
        if "dp_all_reduce" in ov:
            calls = ctx.bucket_calls(gx, gy, gz)
            lat = ld.time(ALL_REDUCE, 0.0)
            per_byte = (ld.time(ALL_REDUCE, w_total) - lat) / w_total
            share = calls / w_total

            def dtime(nbytes: float) -> float:
                return nbytes * (share * lat + per_byte)

            big_d = dtime(block_el * FP32)
            big_h, big_e = dtime(head_el * FP32), dtime(emb_el * FP32)
            slack = comp.block_bwd + (comp.block_fwd if checkpointing else 0.0)
            x = _max0(big_h - slack)
            if L > 1:
                x = (
                    x + (L - 1) * (big_d - slack)
                    if big_d >= slack
                    else _max0(x - (L - 1) * (slack - big_d))
                )
            exp = x + big_d + big_e
            add(
                "gradients",
                "backward",
                "data",
                ALL_REDUCE,
                w_total / calls,
                calls,
                ld.time(ALL_REDUCE, w_total / calls),
                exp,
                "backward of the blocks below (last micro-batch, buckets)",
            )
        else:
            t = ld.time(ALL_REDUCE, w_total)
            add("gradients", "step", "data", ALL_REDUCE, w_total, 1, t, t)

    # ---- step-level scalars and vectors -----------------------------------------------------
    pv = vec_el * FP32
    for ax in ("z", "data"):
        if sizes[ax] > 1:
            t = links[ax].time(ALL_REDUCE, pv)
            add("norm_gradients", "step", ax, ALL_REDUCE, pv, 1, t, t)
    for ax in ("z", "data"):
        if sizes[ax] > 1:
            t = links[ax].time(ALL_REDUCE, FP32)
            add("loss_scalar", "step", ax, ALL_REDUCE, FP32, 1, t, t)
    if gd * gz * gy * gx > 1:
        t = links["world"].time(ALL_REDUCE, 8)
        add("grad_norm", "step", "world", ALL_REDUCE, 8, 1, t, t)

    compute = acc * (fwd_mb + bwd_mb + rec_mb) + optimizer
    step = compute + sum(exposed.values())
    cols: tuple = ()
    if rec is not None:
        cols = tuple(
            Collective(
                layer,
                phase,
                axis,
                kind,
                payload,
                calls,
                ring_bytes(kind, payload, sizes.get(axis, gd * gz * gy * gx)),
                t,
                hid,
                exp,
            )
            for (layer, phase, axis, kind), (payload, calls, t, hid, exp) in rec.items()
        )
    return Estimate(step, compute, acc * rec_mb, exposed, total, acc, cols)


def _z_windows(
    ctx, comp: BlockCompute, names, t_ag, t_rs, t_ag_h, t_rs_h, acc, ckpt, pre, rsa, add, lz, xy, c
) -> None:
    """Z all-gathers and reduce-scatters of one micro-batch walked through the compute windows
    (module doc), times ``acc`` micro-batches; records per collective via ``add``."""
    model, L, n = ctx.model, ctx.model.n_layers, len(names)
    g, post_f, post_b = comp.gemm, comp.post_fwd, comp.post_bwd
    fwin = [g[i] + post_f[i] for i in range(n)]
    bwin = [2.0 * g[i] + post_b[i - 1] for i in range(n)]
    # exposure accumulators: per (layer, phase, kind) -> seconds per micro-batch
    exp_ag: dict = {}
    exp_rs: dict = {}

    def window(cwin: float, rs_key, rs_t: float, ag_key, ag_t: float, mult: float) -> float:
        """One window: the queued reduce-scatter then the prefetch; returns the carried-over
        reduce-scatter time (when no all-gather waits at the window's end)."""
        if not rsa:
            rs_t = 0.0
        if ag_key is None:  # nothing waits at the window's end: the reduce-scatter carries over
            return _max0(rs_t - cwin)
        avail = cwin if pre else 0.0
        stall = _max0(rs_t + ag_t - avail)
        if stall > 0.0:
            tot = rs_t + ag_t
            if rs_key is not None and rs_t > 0.0:
                exp_rs[rs_key] = exp_rs.get(rs_key, 0.0) + mult * stall * rs_t / tot
            exp_ag[ag_key] = exp_ag.get(ag_key, 0.0) + mult * stall * ag_t / tot
        return 0.0

    def block(mult: float, top: bool, bottom: bool) -> float:
        """Windows of one block (``mult`` such blocks); returns the carried-over RS time."""
        last_fwd = ("output", "forward") if top else (names[0], "forward")
        for i in range(n):  # forward
            if i < n - 1:
                window(fwin[i], None, 0.0, (names[i + 1], "forward"), t_ag[i + 1], mult)
            else:
                window(fwin[i], None, 0.0, last_fwd, t_ag_h if top else t_ag[0], mult)
        rs_above = (("output", "backward"), t_rs_h) if top else ((names[0], "backward"), t_rs[0])
        if ckpt:  # recompute windows
            for i in range(n):
                rs_key, rs_t = rs_above if i == 0 else (None, 0.0)
                if i < n - 1:
                    window(fwin[i], rs_key, rs_t, (names[i + 1], "recompute"), t_ag[i + 1], mult)
                else:
                    window(fwin[i], rs_key, rs_t, (names[i], "backward"), t_ag[i], mult)
        carry = 0.0
        for i in range(n - 1, -1, -1):  # backward windows
            if i == n - 1:
                rs_key, rs_t = (None, 0.0) if ckpt else rs_above
            else:
                rs_key, rs_t = (names[i + 1], "backward"), t_rs[i + 1]
            if i >= 1:
                window(bwin[i], rs_key, rs_t, (names[i - 1], "backward"), t_ag[i - 1], mult)
            elif bottom:
                carry = window(bwin[i], rs_key, rs_t, None, 0.0, mult)
            else:
                nxt = (names[0], "recompute") if ckpt else (names[n - 1], "backward")
                window(bwin[i], rs_key, rs_t, nxt, t_ag[0] if ckpt else t_ag[n - 1], mult)
        return carry

    # embedding window: block 1's first weight is prefetched behind the lookup and first norm
    emb_win = comp.embedding_fwd + comp.post_fwd[n - 1] * 0.5
    first = (names[0], "forward")
    window(emb_win, None, 0.0, first, t_ag[0], 1.0)
    if L == 1:
        carry = block(1.0, True, True)
    else:
        block(1.0, True, False)
        if L > 2:
            block(float(L - 2), False, False)
        carry = block(1.0, False, True)
    # LM head: its backward gather behind head forward + loss; the next gather behind its backward
    head_f = comp.head + comp.loss_fwd + comp.loss_bwd
    window(head_f, None, 0.0, ("output", "backward"), t_ag_h, 1.0)
    head_b = 2.0 * comp.head + comp.final_norm_bwd
    nxt = (names[0], "recompute") if ckpt else (names[n - 1], "backward")
    window(head_b, None, 0.0, nxt, t_ag[0] if ckpt else t_ag[n - 1], 1.0)
    # tail: block 1's first reduce-scatter behind the embedding backward, the embedding's exposed
    if rsa:
        tail = _max0(carry + t_rs[0] - comp.embedding_bwd)
        k1 = (names[1 % n], "backward")
        part = tail * carry / (carry + t_rs[0]) if carry > 0.0 else 0.0
        exp_rs[k1] = exp_rs.get(k1, 0.0) + part
        exp_rs[(names[0], "backward")] = exp_rs.get((names[0], "backward"), 0.0) + tail - part
    # ---- record ------------------------------------------------------------------------------
    n_tab = 2 if model.max_positions else 1
    emb_rows = model.vocab  # per table; positions use max_positions rows
    hidden_ag = "previous layer's compute (prefetch)" if pre else ""
    hidden_rs = "later backward compute (async)" if rsa else ""
    for i, (name, nk, *_r) in enumerate(ctx.lin):
        cnt = ctx.lin[i][5]
        calls = L * acc * cnt
        pay_ag, pay_rs = nk / xy * c, nk / xy * FP32
        for phase, k in (("forward", 1), ("recompute", 1 if ckpt else 0), ("backward", 1)):
            if not k:
                continue
            key = (name, phase)
            exp = acc * exp_ag.get(key, 0.0) if pre else calls * t_ag[i]
            add(name, phase, "z", ALL_GATHER, pay_ag, calls, t_ag[i], exp, hidden_ag)
        exp = acc * exp_rs.get((name, "backward"), 0.0) if rsa else calls * t_rs[i]
        if not pre and rsa:  # queued ahead of a blocking all-gather: exposed
            exp = calls * t_rs[i]
        add(name, "backward", "z", REDUCE_SCATTER, pay_rs, calls, t_rs[i], exp, hidden_rs)
    for phase in ("forward", "backward"):
        exp = acc * exp_ag.get(("output", phase), 0.0) if pre else acc * t_ag_h
        add(
            "output",
            phase,
            "z",
            ALL_GATHER,
            model.hidden * model.vocab / xy * c,
            acc,
            t_ag_h,
            exp,
            hidden_ag,
        )
    exp = acc * exp_rs.get(("output", "backward"), 0.0) if rsa and pre else acc * t_rs_h
    add(
        "output",
        "backward",
        "z",
        REDUCE_SCATTER,
        model.hidden * model.vocab / xy * FP32,
        acc,
        t_rs_h,
        exp,
        hidden_rs,
    )
    for tab, rows in (("embedding", emb_rows), ("positions", model.max_positions))[:n_tab]:
        pay = rows * model.hidden / xy * FP32
        t_g, t_r = lz.time(ALL_GATHER, pay), lz.time(REDUCE_SCATTER, pay)
        add(tab, "forward", "z", ALL_GATHER, pay, acc, t_g, acc * t_g)
        add(tab, "backward", "z", REDUCE_SCATTER, pay, acc, t_r, acc * t_r)


def collectives(
    model: ModelSpec,
    machine: Machine,
    grid: tuple[int, int, int, int],
    micro_batch: int,
    seq_len: int,
    global_batch: int,
    *,
    activation_checkpointing: bool = False,
    overlaps: str | Iterable[str] = "all",
    compute_bytes: int = 2,
    bucket_bytes: int = DP_BUCKET_BYTES,
    domino_min_rows: int = DOMINO_MIN_ROWS,
) -> list[Collective]:
    """Every collective of one optimizer step of tetrad's runtime on one rank: layer, phase,
    axis, kind, payload bytes per call, calls, ring bytes and seconds per call, the compute it
    hides behind and its exposed seconds per step (module doc). ``grid = (G_data, G_z, G_y,
    G_x)``; ``micro_batch`` samples per (data, z) cell. ``compute_bytes``: 2 on GPU (bf16
    autocast), 4 on CPU; ``bucket_bytes`` and ``domino_min_rows``: the runtime's
    ``Overlap`` options.

    Raises:
        PlanError: the batch does not split on the grid, or a bad overlap name.
    """
    ctx = Context(
        model,
        machine,
        seq_len,
        global_batch,
        overlaps=overlaps,
        compute_bytes=compute_bytes,
        bucket_bytes=bucket_bytes,
        domino_min_rows=domino_min_rows,
    )
    return list(
        estimate(ctx, tuple(grid), micro_batch, activation_checkpointing, detail=True).collectives
    )


def axis_totals(cols: Iterable[Collective]) -> dict[str, dict[str, float]]:
    """Per axis: ``calls``, ``payload_bytes`` and ring ``bytes`` per step, the quantities the
    runtime's ``tetrad.comm.CommLog`` records (``AxisStats``)."""
    out: dict[str, dict[str, float]] = {}
    for col in cols:
        a = out.setdefault(
            col.axis,
            {"calls": 0, "payload_bytes": 0.0, "bytes": 0.0, "time_s": 0.0, "exposed_s": 0.0},
        )
        a["calls"] += col.calls
        a["payload_bytes"] += col.calls * col.payload_bytes
        a["bytes"] += col.calls * col.ring_bytes
        a["time_s"] += col.total_s
        a["exposed_s"] += col.exposed_s
    return out


# =============================================================================================
# AxoNN's published model
# =============================================================================================

AXONN_BYTES = 2
"""AxoNN counts every volume in bf16 elements (``* 2`` bytes)."""


def axonn_linear_volumes(
    n: int, k: int, transposed: bool, tokens: float, grid: tuple[int, int, int, int], grad_acc: int
) -> dict[str, float]:
    """AxoNN's ``model_v2`` volumes (GiB) of one Linear ``[n, k]`` per iteration, as coded.

    ``tokens`` = ``B S / (G_data G_z)`` (all micro-batches of one Z slice of one replica). With
    ``f(G) = (G-1)/G``, in bf16 elements:

        data  4 f(G_data) n k / (G_x G_y G_z)
        z     3 f(G_z) n k / (G_x G_y) * grad_acc
        non-transposed (k -> n):  x 4 f(G_x) t n / G_y     y 2 f(G_y) t k / G_x
        transposed, as coded:     x 2 f(G_x) t n / G_y     y 4 f(G_y) t k / G_x

    For AxoNN's ``K H -> H`` layer the transposed branch reads ``2 f(G_x) t H / G_y`` and
    ``4 f(G_y) t K H / G_x``: K sits on the Y term, while the layout gives a backward X
    all-reduce of ``t K H / G_y`` and a forward (x2 recompute) Y all-reduce of ``t H / G_x``.
    """
    gd, gz, gy, gx = grid

    def f(g: int) -> float:
        return (g - 1) / g

    nk = n * k
    out = {
        "data": 4 * f(gd) * nk / (gx * gy * gz),
        "z": 1.5 * 2 * f(gz) * nk / (gx * gy) * grad_acc,
    }
    if not transposed:
        out["x"] = 2 * 2 * f(gx) * tokens * n / gy
        out["y"] = 2 * f(gy) * tokens * k / gx
    else:
        out["x"] = 2 * f(gx) * tokens * n / gy
        out["y"] = 2 * 2 * f(gy) * tokens * k / gx
    return {a: v * AXONN_BYTES / GiB for a, v in out.items()}  # AxoNN: GiB over GB/s


def axonn_comm(
    model: ModelSpec,
    machine: Machine,
    grid: tuple[int, int, int, int],
    global_batch: int,
    seq_len: int,
    grad_acc: int = 1,
) -> dict[str, float]:
    """AxoNN's predicted communication seconds per iteration, per axis (and ``total``).

    Reproduces Megatron-AxoNN ``examples/comm_model.py`` (``model_v2`` summed over a block's
    Linears, times ``num_layers``): volume (GiB) / bandwidth (GB/s) of the axis's placement
    (``get_bw(ip, my)``, here :meth:`Network.bandwidth_gbps`), summed over axes. For AxoNN's GPT
    block (QKV h->3h, out-proj h->h transposed, FC1 h->4h, FC2 4h->h transposed) this is their
    model exactly; for other models the block's Linears are used with the same rule.

    Deviations from the true layout (and from :func:`estimate`):

    - transposed Linears put K on the Y term instead of X (:func:`axonn_linear_volumes`): FC2's
      X traffic is under-counted 4x, its Y traffic over-counted 4x;
    - full recomputation is always assumed (forward all-reduce x2), yet Z counts 3 collectives
      (the recompute's extra all-gather is missing) and the dW reduce-scatter in bf16 (fp32 in
      tetrad);
    - no embedding, LM head, norms, loss, scalars; no latency; no overlap;
    - GiB (2^30) divided by GB/s.
    """
    gd, gz, gy, gx = grid
    net = machine.network
    tokens = global_batch * seq_len / (gd * gz)
    strides = {"x": (1, gx), "y": (gx, gy), "z": (gx * gy, gz), "data": (gx * gy * gz, gd)}
    out = dict.fromkeys(("x", "y", "z", "data"), 0.0)
    for lin in model.linears():
        vols = axonn_linear_volumes(
            lin.out_features, lin.in_features, lin.transposed, tokens, grid, grad_acc
        )
        for a, v in vols.items():
            ip, my = strides[a]
            if my > 1:
                out[a] += lin.count * v / net.bandwidth_gbps(ip, my)
    out = {a: model.n_layers * v for a, v in out.items()}
    out["total"] = sum(out.values())
    return out


def layer_bytes(
    n: int,
    k: int,
    transposed: bool,
    grid: tuple[int, int, int, int],
    tokens: int,
    compute_bytes: int = 2,
) -> dict[tuple[str, str, str], float]:
    """Payload bytes of one call of each collective of one Linear ``[n, k]`` on ``grid`` for
    ``tokens`` tokens per rank (the runtime's layout; keys ``(phase, axis, kind)``; size-1 axes
    omitted). A convenience for tests and hand checks."""
    gd, gz, gy, gx = grid
    sizes = {"x": gx, "y": gy, "z": gz}
    in_ax, out_ax = ("y", "x") if transposed else ("x", "y")
    c = compute_bytes
    out = {}
    if gz > 1:
        out[("forward", "z", ALL_GATHER)] = n * k / (gx * gy) * c
        out[("backward", "z", ALL_GATHER)] = n * k / (gx * gy) * c
        out[("backward", "z", REDUCE_SCATTER)] = n * k / (gx * gy) * FP32
    if sizes[in_ax] > 1:
        out[("forward", in_ax, ALL_REDUCE)] = tokens * n / sizes[out_ax] * c
    if sizes[out_ax] > 1:
        out[("backward", out_ax, ALL_REDUCE)] = tokens * k / sizes[in_ax] * c
    return out
