"""Checks of the mixture-of-experts fields of :class:`tetrad.models.config.ModelConfig`: which
values describe a model, and which grids the MoE runtime supports. Plain Python."""

from __future__ import annotations

from typing import Protocol

from tetrad.plan.model.grids import with_context
from tetrad.spec import GridShape


class MoESizes(Protocol):
    """The fields these checks read (a :class:`tetrad.models.config.ModelConfig`)."""

    n_experts: int
    top_k: int
    expert_ffn_dim: int
    shared_ffn_dim: int
    moe_every: int
    dense_layers: int
    router_score: str
    route_scale: float
    aux_loss_coef: float
    aux_loss_scope: str
    bias_update_rate: float
    qk_norm: bool

    @property
    def is_moe(self) -> bool: ...


ROUTER_SCORES = ("softmax", "sigmoid")
AUX_LOSS_SCOPES = ("sequence", "batch")


def moe_problems(cfg: MoESizes) -> list[str]:
    """What is wrong with the mixture-of-experts fields of ``cfg`` (empty: nothing; a dense
    model with the default fields has nothing wrong)."""
    bad = []
    if cfg.router_score not in ROUTER_SCORES:
        bad.append(f"router_score={cfg.router_score!r} is not one of {', '.join(ROUTER_SCORES)}")
    if cfg.aux_loss_scope not in AUX_LOSS_SCOPES:
        bad.append(
            f"aux_loss_scope={cfg.aux_loss_scope!r} is not one of {', '.join(AUX_LOSS_SCOPES)}"
        )
    if cfg.n_experts < 0 or cfg.moe_every < 1 or cfg.dense_layers < 0:
        bad.append("n_experts and dense_layers must be >= 0, moe_every >= 1")
    if cfg.n_experts and not 1 <= cfg.top_k <= cfg.n_experts:
        bad.append(f"top_k={cfg.top_k} must be between 1 and n_experts={cfg.n_experts}")
    if min(cfg.expert_ffn_dim, cfg.shared_ffn_dim) < 0 or cfg.route_scale <= 0:
        bad.append("expert_ffn_dim and shared_ffn_dim must be >= 0, route_scale > 0")
    if min(cfg.aux_loss_coef, cfg.bias_update_rate) < 0:
        bad.append("aux_loss_coef and bias_update_rate must be >= 0")
    return bad


def moe_grid_problem(
    cfg: MoESizes, grid: GridShape, pipe: int = 1, expert: int = 1, seq_len: int | None = None
) -> str | None:
    """Why the MoE runtime cannot run ``cfg`` on ``grid = (G_data, G_context, G_z, G_y, G_x)``
    with ``pipe`` stages, expert parallelism ``expert`` and sequences of ``seq_len`` tokens
    (None: not checked), in one line that names what to use instead; None when it can (and for
    every dense model without expert parallelism).

    The router is replicated on every rank; the experts too, or split over ``G_expert`` ranks
    folded over data x context (:mod:`tetrad.parallel.experts`). MoE models run on every axis:
    on Y and X each tensor rank routes its own slice of the tokens
    (:mod:`tetrad.parallel.moe_tensor`; the sequence positions per rank must divide by
    ``G_y G_x``).
    """
    data, context, _, y, x = (int(g) for g in with_context(grid))
    if not cfg.is_moe:
        if expert > 1:
            return f"expert parallelism {expert} needs a model with experts: drop --expert-parallel"
        return None
    if seq_len is not None and seq_len % (context * y * x):
        return (
            f"MoE on G_y*G_x={y * x} tensor ranks splits each rank's {seq_len}/G_context "
            f"positions {y * x} ways: use a seq_len divisible by G_context*G_y*G_x="
            f"{context * y * x}"
        )
    if expert > 1 and (cfg.n_experts % expert or (data * context) % expert):
        return (
            f"expert parallelism {expert} must divide n_experts={cfg.n_experts} and "
            f"G_data*G_context={data * context}: change --expert-parallel"
        )
    return None
