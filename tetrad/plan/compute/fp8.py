"""FP8 training in the step model: which block Linears a scaling recipe runs in FP8
(:func:`converts`), the seconds of such a Linear's GEMMs with their casts (:func:`fp8_gemm`), the
bytes of its weight's Z all-gather (:func:`z_weight_bytes`) and the check of a recipe against a
machine (:func:`check_fp8`).

Recipes (torchao.float8, ``torchao/float8/``; facts in ``/work/shared/notes/fp8-training.md``):

- ``tensorwise``: one dynamic scale per tensor; every block Linear runs its three GEMMs
  (forward, dx, dW) in FP8. A weight sharded over Z, Y and X needs the whole tensor's amax: one
  all-reduce (max) of a scalar over the ``G_z G_y G_x`` ranks that shard it
  (:mod:`tetrad.plan.comm.fp8_scales`), and its Z all-gather can move the FP8 shard, 1 byte per
  element instead of the compute dtype's (FSDP2's ``enable_fsdp_float8_all_gather``, which
  exists for tensorwise only).
- ``rowwise``: a scale per row of the activations and per column of the weights; torchao's auto
  filter (``float8_linear_utils.py``) leaves a Linear ``[N, K]`` in the compute dtype when
  ``N <= 2048``, ``K <= 1024`` or ``N <= 4096 and K <= 2048`` (the full weight's shape; tetrad's
  fused ``wqkv`` and ``w13`` are one module each). Its collectives stay in the compute dtype.

The embedding, the LM head, the router and the norms stay in the compute dtype under both.

Casts are memory bound: each GEMM casts both its operands (torchao's float8 matmul: forward
``x`` and ``W``, dx ``dy`` and ``W``, dW ``dy`` and ``x``), each cast a pass that reads the bf16
tensor for its amax and a pass that reads it again and writes the FP8 copy:
:data:`CAST_BYTES` = 2 + 2 + 1 bytes per element, at HBM bandwidth. Check: FBGEMM PR #2546 on
an H100 timed an 8192^3 FP8 GEMM at 0.977 ms alone and 1.180 ms with its scaling; the two
8192^2 operands at 5 B per element over 3.35 TB/s add 0.200 ms. A weight cast is counted at its
gathered size ``n k / (G_x G_y)`` (an upper bound under tensorwise with ``G_z > 1``, which may
cast the Z shard before gathering it).

Rowwise GEMMs are slower than tensorwise ones: PyTorch's rowwise ``_scaled_mm`` is a CUTLASS
kernel at 90-100% of the tensorwise (cuBLAS) efficiency for most shapes, with a tail down to 50%
(pytorch/pytorch#147971), and torchao runs rowwise's backward GEMMs (slow accumulation) as the
tensorwise cuBLAS GEMM followed by a rescaling kernel over the output (pytorch/ao#1325): the
model takes :data:`ROWWISE_GEMM_FACTOR` of the FP8 rate and :data:`RESCALE_BYTES` per element
of the dx and dW outputs. Check against torchao's README (pytorch/ao#1793): Llama 3 8B on 8 H100s
with FSDP2, 6019 tokens/s bf16, 7190 tensorwise (1.19x), 6649 rowwise (1.10x).

The casts of a Linear are charged to its GEMMs, one third to each (``BlockCompute.gemm`` is one
GEMM's seconds, forward = dx = dW), so every window and bound that counts GEMMs counts them.
Memory is left as the bf16 estimate: torchao keeps the high-precision activations for backward,
and the FP8 copies are transient (one GEMM's operands at a time); with the FP8 Z all-gather the
gathered weights in flight are half the bf16 ones, so the estimate is an upper bound there.
"""

from __future__ import annotations

from tetrad.plan.errors import PlanError
from tetrad.plan.machine.description import Machine
from tetrad.spec.model import Linear
from tetrad.spec.precision import FP8_RECIPES, fp8_converts  # noqa: F401 (the planner's too)

CAST_BYTES = 5.0
"""Bytes moved per element of one operand's cast to FP8: read bf16 for the amax (2), read it
again (2) and write the FP8 copy (1) (module doc)."""

FP8_BYTES = 1
"""Bytes of one FP8 (E4M3) element."""

ROWWISE_GEMM_FACTOR = 0.9
"""A rowwise FP8 GEMM's rate over a tensorwise one's (pytorch/pytorch#147971: most shapes at
90-100%, a tail lower; module doc)."""

RESCALE_BYTES = 4.0
"""Bytes per output element of rowwise's backward rescaling kernel: read and write bf16
(pytorch/ao#1325; module doc)."""


def converts(lin: Linear, recipe: str) -> bool:
    """Whether ``recipe`` runs ``lin``'s GEMMs in FP8, as the runtime decides it
    (:func:`tetrad.spec.precision.fp8_converts`: ``tensorwise`` every block Linear, ``rowwise``
    those torchao's auto filter keeps, ``off`` none)."""
    return fp8_converts(recipe, lin.out_features, lin.in_features)


def cast_elements(lin: Linear, m: int, gx: int, gy: int) -> float:
    """Elements one rank casts for ``lin``'s three GEMMs of one micro-batch of ``m`` tokens:
    ``2 (x + W + dy)`` with ``x = m k / G_in``, ``W = n k / (G_x G_y)``, ``dy = m n / G_out``
    (each operand is cast for two of the three GEMMs)."""
    g_in, g_out = (gy, gx) if lin.transposed else (gx, gy)
    n, k = lin.out_features, lin.in_features
    return 2.0 * lin.count * (m * k / g_in + n * k / (gx * gy) + m * n / g_out)


def rescale_elements(lin: Linear, m: int, gx: int, gy: int) -> float:
    """Output elements of ``lin``'s two backward GEMMs on one rank (rowwise's rescaling):
    ``dx = m k / G_in`` and ``dW = n k / (G_x G_y)``."""
    g_in = gy if lin.transposed else gx
    n, k = lin.out_features, lin.in_features
    return lin.count * (m * k / g_in + n * k / (gx * gy))


def fp8_gemm(
    lin: Linear,
    flops: float,
    m: int,
    gx: int,
    gy: int,
    machine: Machine,
    fp8_efficiency=None,
    with_casts: bool = True,
    recipe: str = "tensorwise",
) -> tuple[float, float]:
    """``(seconds of one GEMM, seconds of casts per micro-batch)`` of an FP8 Linear on one rank:
    ``flops / (fp8 peak * efficiency) + casts / 3`` and the casts,
    :data:`CAST_BYTES` per :func:`cast_elements` over the HBM bandwidth; ``rowwise``: the rate
    times :data:`ROWWISE_GEMM_FACTOR`, and the casts with :data:`RESCALE_BYTES` per
    :func:`rescale_elements`.

    Args:
        flops: one GEMM's FLOPs on this rank.
        fp8_efficiency: flops -> fraction of the FP8 peak (default: the machine's FP8 table).
        with_casts: False: the GEMM alone and no casts (a lower bound's).
        recipe: ``tensorwise`` or ``rowwise``.
    """
    eff = fp8_efficiency or machine.fp8_gemm_efficiency
    peak = machine.fp8_peak_flops * (ROWWISE_GEMM_FACTOR if recipe == "rowwise" else 1.0)
    gemm = flops / (peak * eff(flops)) if flops else 0.0
    if not with_casts:
        return gemm, 0.0
    moved = CAST_BYTES * cast_elements(lin, m, gx, gy)
    if recipe == "rowwise":
        moved += RESCALE_BYTES * rescale_elements(lin, m, gx, gy)
    casts = moved / machine.hbm_bytes_per_s
    return gemm + casts / 3.0, casts


def z_weight_bytes(recipe: str, compute_bytes: int) -> int:
    """Bytes per element of a block Linear's weight on its Z all-gather: FP8 under
    ``tensorwise`` (the recipe whose scale is the whole tensor's, so the shard can be cast
    before gathering), else the compute dtype's."""
    return FP8_BYTES if recipe == "tensorwise" else compute_bytes


def check_fp8(recipe: str, machine: Machine) -> None:
    """Raises :class:`PlanError` (one line) for an unknown recipe, or an FP8 recipe on a
    machine that describes no FP8 GEMMs."""
    if recipe not in FP8_RECIPES:
        raise PlanError(f"--fp8 {recipe!r} is unknown: use one of {', '.join(FP8_RECIPES)}")
    if recipe != "off" and not machine.has_fp8:
        raise PlanError(
            f"--fp8 {recipe}: machine {machine.name} ({machine.gpu}) describes no FP8 GEMMs: "
            "use --fp8 off, or a machine with peak_fp8_tflops and fp8_gemm_efficiency "
            "(dgx-h100, h200-node)"
        )
