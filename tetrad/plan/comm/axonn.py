"""AxoNN's published communication model (``--comm-model axonn``).

Reproduces Megatron-AxoNN ``examples/comm_model.py`` (``model_v2``; Singh et al., arXiv
2305.13525): per block Linear, volume terms in bf16 elements, GiB over the measured bandwidth of
the axis's placement, summed over axes and layers; no latency, no overlap, no embedding, LM head,
norms or loss. Where it deviates from tetrad's true layout (and from
:func:`tetrad.plan.step_time.estimate`), see :func:`axonn_comm`.
"""

from __future__ import annotations

from tetrad.plan.machine.description import Machine
from tetrad.spec.grid import GRID_AXES
from tetrad.spec.model import ModelSpec
from tetrad.spec.units import GiB

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
    (``get_bw(ip, my)``, here :meth:`tetrad.plan.machine.network.Network.bandwidth_gbps`),
    summed over axes. For AxoNN's GPT block (QKV h->3h, out-proj h->h transposed, FC1 h->4h,
    FC2 4h->h transposed) this is their model exactly; for other models the block's Linears are
    used with the same rule.

    Deviations from the true layout (and from :func:`tetrad.plan.step_time.estimate`):

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
    out = dict.fromkeys(reversed(GRID_AXES), 0.0)
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
