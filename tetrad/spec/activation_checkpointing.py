"""Activation-checkpointing modes, shared by the runtime and the planner (plain Python): their
names, the ``selective:K`` form, which blocks each mode checkpoints and in what order the
planner tries them. Nothing here imports torch."""

from __future__ import annotations

import functools

from tetrad.spec.errors import TetradError

CHECKPOINTING = ("none", "selective", "full")
"""Activation-checkpointing modes: ``none`` keeps every saved tensor; ``selective`` keeps the
GEMM and attention outputs and recomputes RMSNorm, RoPE and SwiGLU in backward (Korthikanti et
al., arXiv 2205.05198, section 5: recompute what is cheap and memory-hungry); ``full`` keeps
only each block's input and recomputes the block.

``selective:K`` (``K >= 1``) is partial selective checkpointing: the last ``K`` blocks (those
nearest the LM head) are selective, the others ``none``, so a model that almost fits without
recomputation pays for only as many blocks as memory requires (Korthikanti et al. section 5
checkpoint a subset of layers the same way). Only ``selective`` takes a count: it re-runs no
collective, so the blocks differ in memory and element-wise time only."""


class CheckpointingError(TetradError):
    """An activation-checkpointing mode that is not one of :data:`CHECKPOINTING` or
    ``selective:K``."""


@functools.lru_cache(maxsize=256, typed=True)  # the planner's searches ask ~10^5 times
def parse_checkpointing(value: str | bool, also: str = "") -> str:
    """A mode of :data:`CHECKPOINTING` or ``selective:K`` from its name or a bool (``True`` =
    ``full``); ``also``: what else the caller takes, named in the unknown-name message.

    Raises:
        CheckpointingError: an unknown name, or a block count that is not a positive integer.
    """
    if isinstance(value, bool):
        return "full" if value else "none"
    name = str(value).strip().lower()
    name = {"on": "full", "off": "none", "true": "full", "false": "none"}.get(name, name)
    base, sep, count = name.partition(":")
    if base == "selective" and sep:
        if not count.strip().isdigit() or int(count) < 1:
            raise CheckpointingError(
                f"activation checkpointing {value!r}: selective:K needs a block count K >= 1 "
                "(for example selective:12), or use none"
            )
        return f"selective:{int(count)}"
    if name not in CHECKPOINTING:
        raise CheckpointingError(
            f"activation checkpointing {value!r} is unknown: use {', '.join(CHECKPOINTING)} "
            "or selective:K (the last K blocks selective)" + (f", or {also}" if also else "")
        )
    return name


def checkpointed_blocks(mode: str | bool, n_layers: int) -> tuple[str, int]:
    """``(base mode, K)``: the last ``K`` of ``n_layers`` blocks use the base mode of
    :data:`CHECKPOINTING`, the others ``none`` (``K = n_layers`` for a plain mode, 0 for
    ``none``).

    Raises:
        CheckpointingError: an unknown mode, or ``selective:K`` with ``K > n_layers``.
    """
    mode = parse_checkpointing(mode)
    base, _, count = mode.partition(":")
    if base == "none":
        return base, 0
    k = int(count) if count else n_layers
    if k > n_layers:
        raise CheckpointingError(
            f"activation checkpointing {mode}: the model has only {n_layers} blocks; "
            f"use selective:{n_layers} (or selective) or fewer"
        )
    return base, k


def recompute_order(mode: str | bool) -> tuple[int, float]:
    """Sort key from the least recomputation to the most: ``none``, ``selective:K`` by ``K``,
    ``selective``, ``full``.

    Raises:
        CheckpointingError: an unknown mode.
    """
    base, _, count = parse_checkpointing(mode).partition(":")
    return CHECKPOINTING.index(base), float(count) if count else float("inf")
