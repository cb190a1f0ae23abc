"""How an MoE model routes, as a run reports it: per MoE block and step, the max/mean expert
load and the normalised load-balancing term, summed over every rank so that each grid reports
the single-process values; and the warning of a block whose routing collapses.

The statistics are gathered on the device during the step
(:meth:`tetrad.models.llama.Transformer.record_routing`) and summed over the ranks only at a
logging boundary, with the step's other values: no host read on the step path. Every rank's
statistics are its own tokens' (data, context, Z, expert: other samples or positions; Y and X:
other slices of the same positions, :mod:`tetrad.parallel.moe_tensor`; pipeline stages: other
blocks), so the sum over the whole world is the single process's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tetrad.comm import all_reduce
from tetrad.grid import Grid
from tetrad.models.llama import Transformer
from tetrad.models.moe import routing_figures
from tetrad.spec.grid import Axis
from tetrad.spec.model import ModelSpec

LOAD_WARN = 1.5
"""The max/mean expert load above which a block's routing counts as collapsing: the busiest
expert gets 50% more token slots than the mean (1 is balanced, ``E/k`` total collapse; issue 47
asks a healthy run to stay below 1.3 after its first 100 steps)."""
WARN_STEPS = 5
"""Consecutive steps above :data:`LOAD_WARN` before a block is named."""
EXPERT_LOADS_MAX = 64
"""The most experts whose loads a ``metrics.jsonl`` row lists one by one (``moe_expert_load``):
beyond, a row would grow by ``L_m E`` numbers (DeepSeek-V3: 58 x 256)."""


def moe_block_ids(cfg: ModelSpec) -> list[int]:
    """The MoE blocks of the whole model, 0-based block indices in order."""
    return [i for i in range(cfg.n_layers) if cfg.moe_block(i)]


def take_step_routing(parts: Iterable[Transformer], cfg: ModelSpec) -> torch.Tensor | None:
    """This rank's routing statistics of the step just run, ``[L_m, E + 2]`` fp32 on the
    device (row ``j`` the ``j``-th MoE block of :func:`moe_block_ids`, zeros for the blocks of
    other pipeline stages; layout of :attr:`tetrad.models.moe.MoEFeedForward.routing`), taken
    from ``parts`` (:meth:`~tetrad.models.llama.Transformer.take_routing`: the next step
    starts from zero). No host read. None for a dense model (zeros, for a stage without MoE
    blocks, still take part in :func:`sum_routing`)."""
    blocks = moe_block_ids(cfg)
    if not blocks:
        return None
    parts = list(parts)
    device = next(parts[0].parameters()).device
    out = torch.zeros(len(blocks), cfg.n_experts + 2, device=device)
    for part in parts:
        for i, stats in part.take_routing().items():
            out[blocks.index(i)] = stats
    return out


def sum_routing(stats: torch.Tensor, grid: Grid) -> torch.Tensor:
    """``stats [..., L_m, E + 2]`` (:func:`take_step_routing`'s, stacked over steps) summed in
    place over every rank of the grid (each rank's are its own tokens' or its own blocks')."""
    return all_reduce(stats, grid, Axis.WORLD)


def routing_row(stats: torch.Tensor | list, cfg: ModelSpec, sequences: int) -> dict[str, dict]:
    """The ``metrics.jsonl`` entries of one step from its statistics summed over the grid,
    ``[L_m, E + 2]`` (:func:`sum_routing`), and its global batch of ``sequences``, each keyed by
    the MoE block's index: ``moe_max_load`` (the max/mean expert load), ``moe_balance`` (the
    block's load-balancing term over its coefficient, 1.0 balanced; only when
    ``aux_loss_coef > 0``; :func:`tetrad.models.moe.routing_figures`), ``moe_z_loss`` (the
    block's router z-loss, its coefficient left out; only when ``router_z_loss_coef > 0``) and,
    for at most
    :data:`EXPERT_LOADS_MAX` experts, ``moe_expert_load`` (each expert's slots over the mean,
    ``E`` values rounded to 4 decimals: 1 each when balanced)."""
    stats = torch.as_tensor(stats, dtype=torch.float64)
    max_load, balance, z_loss = routing_figures(stats, sequences)
    blocks = [str(i) for i in moe_block_ids(cfg)]
    row = {"moe_max_load": dict(zip(blocks, max_load.tolist(), strict=True))}
    if cfg.aux_loss_coef > 0:
        row["moe_balance"] = dict(zip(blocks, balance.tolist(), strict=True))
    if cfg.router_z_loss_coef > 0:
        row["moe_z_loss"] = dict(zip(blocks, z_loss.tolist(), strict=True))
    if cfg.n_experts <= EXPERT_LOADS_MAX:
        counts = stats[:, :-2]
        loads = counts / counts.mean(-1, keepdim=True).clamp_min(1e-300)
        per_block = [[round(v, 4) for v in block] for block in loads.tolist()]
        row["moe_expert_load"] = dict(zip(blocks, per_block, strict=True))
    return row


def routing_summary(row: dict) -> str:
    """The progress line's part for a row with :func:`routing_row`'s entries: the worst block's
    max/mean load and the worst normalised balance term (empty for a dense model's row)."""
    if "moe_max_load" not in row:
        return ""
    loads = row["moe_max_load"]
    block = max(loads, key=loads.get)
    text = f" | load {loads[block]:.2f} (block {block})"
    if "moe_balance" in row:
        text += f" balance {max(row['moe_balance'].values()):.3f}"
    return text


class RoutingWatch:
    """Names a collapsing block: one line when an MoE block's max/mean load has stayed above
    ``threshold`` for ``steps`` consecutive steps; the block is named again only after it has
    stayed at or below the threshold for ``steps`` steps (a load wavering around the threshold
    gives one line, not one per crossing).

    Args:
        cfg: the model (its ``E`` and ``k`` give the load of total collapse, ``E/k``).
        threshold, steps: default :data:`LOAD_WARN` and :data:`WARN_STEPS`.
    """

    def __init__(self, cfg: ModelSpec, threshold: float = LOAD_WARN, steps: int = WARN_STEPS):
        self.collapsed = cfg.n_experts / cfg.top_k if cfg.is_moe else 1.0
        self.threshold, self.steps = threshold, steps
        self.above: dict[str, int] = {}  # block -> consecutive steps above the threshold
        self.below: dict[str, int] = {}  # block -> consecutive steps at or below it
        self.named: set[str] = set()  # blocks warned about and not yet back below

    def update(self, rows: list[dict]) -> list[str]:
        """Take the next ``metrics.jsonl`` rows (in step order); return the warning lines."""
        lines = []
        for row in rows:
            for block, load in row.get("moe_max_load", {}).items():
                high = load > self.threshold
                self.above[block] = self.above.get(block, 0) + 1 if high else 0
                self.below[block] = 0 if high else self.below.get(block, 0) + 1
                if self.below[block] >= self.steps:
                    self.named.discard(block)
                if self.above[block] < self.steps or block in self.named:
                    continue
                self.named.add(block)
                balance = row.get("moe_balance", {}).get(block)
                extra = f", balance term {balance:.2f}" if balance is not None else ""
                lines.append(
                    f"tetrad: warning: routing collapse in MoE block {block}: its busiest "
                    f"expert has had over {self.threshold:g}x the mean load for "
                    f"{self.above[block]} steps (step {row['step']}: {load:.2f}x{extra}; total "
                    f"collapse is {self.collapsed:g}x): raise aux_loss_coef or bias_update_rate"
                )
        return lines
