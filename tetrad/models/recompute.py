"""Selective activation recomputation (Korthikanti et al., arXiv 2205.05198, section 5: keep what
is expensive to recompute, recompute what is cheap and memory-hungry).

Inside :func:`selective` (``Transformer.forward`` enters it around each block when the mode is
``selective`` and grad is on), :func:`cheap` runs an element-wise function (RMSNorm's apply,
RoPE, SwiGLU, a heads-to-tokens copy) as a tiny checkpoint: it saves only the function's inputs
and recomputes it in backward. Its output is tagged with a :class:`Recipe` ``(fn, inputs)``, and
the ``saved_tensors_hooks`` pair that :func:`selective` installs packs a tagged tensor as its
recipe instead of its data: the consumer (the next Linear saving its input for ``dW``, SDPA
saving rotated q and k) keeps no copy, and the tensor is rebuilt from the recipe when backward
unpacks it. That rebuild records its graph, and the function's own backward (which autograd
runs right after the consumer's) differentiates it, so each cheap function runs twice in all:
once in forward, once in backward. Untagged tensors are kept as they are.

No collective and no GEMM is ever re-run: only functions passed to :func:`cheap` are recomputed
(torch's selective-checkpoint machinery would re-run the parallel Linear, whose custom autograd
Function holds collectives). Outside :func:`selective`, :func:`cheap` is ``fn(*inputs)``, so the
``none`` and ``full`` modes are unchanged. Code that ``torch.compile`` traces (the blocks) calls
``recompute.runner()(fn, *inputs)`` instead, the same thing in a form Dynamo compiles once per
mode (see :func:`runner`).

The recomputation restores the forward's autocast state (dtype decisions are the same in both
passes); functions must be deterministic (no dropout).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

observer: Callable[[torch.Tensor], None] | None = None
"""Called with every tensor that selective mode's pack hook keeps as is (tests set it to measure
what is kept; an outer ``saved_tensors_hooks`` does not see tensors packed by the inner one)."""

_active = 0  # depth of selective() contexts


class Recipe:
    """How to rebuild a tagged tensor: ``fn(*inputs)`` under the forward's autocast state."""

    __slots__ = ("fn", "inputs", "autocast", "rebuilt")

    def __init__(self, fn: Callable[..., torch.Tensor], inputs: tuple, autocast: tuple):
        self.fn, self.inputs, self.autocast = fn, inputs, autocast
        self.rebuilt: tuple[list[torch.Tensor], torch.Tensor] | None = None

    def run(self, *inputs: torch.Tensor) -> torch.Tensor:
        """``fn(*inputs)`` (default: the recorded inputs) under the recorded autocast state."""
        device, enabled, dtype = self.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            return self.fn(*(inputs or self.inputs))

    def run_with_grad(self, inputs: tuple, needs: tuple) -> tuple[list[torch.Tensor], torch.Tensor]:
        """``fn`` on detached copies of ``inputs`` (those flagged in ``needs`` require grad),
        recording its graph: ``(leaves, output)``."""
        leaves = [t.detach().requires_grad_(n) for t, n in zip(inputs, needs, strict=True)]
        with torch.enable_grad():
            return leaves, self.run(*leaves)


def _autocast_state(inputs: tuple) -> tuple[str, bool, torch.dtype]:
    device = next((t.device.type for t in inputs if isinstance(t, torch.Tensor)), "cpu")
    return device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)


class _Cheap(torch.autograd.Function):
    """``fn(*inputs)`` saving only ``inputs``; backward recomputes ``fn`` and differentiates it."""

    @staticmethod
    def forward(ctx, recipe: Recipe, *inputs):
        ctx.recipe = recipe
        ctx.save_for_backward(*inputs)
        return recipe.run(*inputs)

    @staticmethod
    def backward(ctx, grad):
        # Every consumer has run its backward by now: drop the recipe and its inputs. Autograd
        # frees a node's saved tensors after its backward, but not the attributes set on ctx,
        # and the graph's nodes live until the whole backward ends: a recipe kept here would
        # hold its inputs (a block's kept activations) until then.
        recipe, ctx.recipe = ctx.recipe, None
        recipe.inputs = ()
        if recipe.rebuilt is not None:  # the consumer's unpack rebuilt it with its graph
            (leaves, out), recipe.rebuilt = recipe.rebuilt, None
        else:
            leaves, out = recipe.run_with_grad(ctx.saved_tensors, ctx.needs_input_grad[1:])
        wanted = [t for t in leaves if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        return (None, *(next(grads) if t.requires_grad else None for t in leaves))


def cheap(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """``fn(*inputs)``; inside :func:`selective` with grad on, recomputed in backward instead of
    kept (see the module docstring). ``runner()(fn, *inputs)``: code compiled by
    ``torch.compile`` calls that instead (see :func:`runner`).

    ``fn`` must be element-wise-cheap, free of collectives and deterministic; ``inputs`` are
    tensors (non-tensor parameters go into ``fn``, e.g. with ``functools.partial``), and they are
    kept for backward.
    """
    return runner()(fn, *inputs)


def runner() -> Callable[..., torch.Tensor]:
    """What runs a cheap function now: :func:`_recomputed` inside :func:`selective` with grad on,
    else :func:`_plain` (``fn(*inputs)``). Call sites write ``recompute.runner()(fn, *inputs)``,
    with nothing that can break the graph (a collective) between ``runner()`` and the call.

    Why not one function testing the mode (as :func:`cheap` does): Dynamo cannot resume a graph
    break inside a function it inlines. A ``cheap`` calling the disabled ``_recomputed`` broke
    inside the inlined ``cheap``, so Dynamo restarted and broke at the caller's ``cheap(...)``:
    ``cheap`` ran as a frame of its own, compiled and guarded on ``fn``, one cache entry per
    wrapped function (torch 2.13: past the recompile limit of 8, then run eagerly; torch 2.11
    told the rotated queries from the keys apart too weakly and gave the keys the queries'
    graph). And the caller's entry, having traced nothing of ``cheap``, did not guard on the
    mode, so blocks run outside selective mode later in the process (``selective:K``'s other
    blocks, another model) reused it and ``cheap``'s frame compiled ``fn(*inputs)`` once per
    function again. Here the caller's own frame traces ``runner()`` (inlined, no graph break:
    its entry guards on the mode), then either inlines ``_plain`` (``fn`` fused into the
    block's graph) or breaks the graph at its own call of the disabled ``_recomputed``.
    """
    return _recomputed if _active and torch.is_grad_enabled() else _plain


def _plain(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    return fn(*inputs)


@torch.compiler.disable
def _recomputed(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """:func:`cheap`'s selective path, run eagerly inside compiled blocks: Dynamo tracing
    ``_Cheap.apply`` with a fresh :class:`Recipe` recompiles once per wrapped function (torch
    2.13: past its recompile limit) or, on torch 2.11 on CUDA, reused the graph of another
    function (rotated queries given for keys), so the recipe is built and applied outside it."""
    recipe = Recipe(fn, inputs, _autocast_state(inputs))
    out = _Cheap.apply(recipe, *inputs)
    out._tetrad_recipe = recipe
    return out


def _pack(t: torch.Tensor) -> Any:
    recipe = getattr(t, "_tetrad_recipe", None)
    if recipe is not None:
        return recipe
    if observer is not None:
        observer(t)
    return t


def _unpack(packed: Any) -> torch.Tensor:
    if not isinstance(packed, Recipe):
        return packed
    if packed.rebuilt is None:  # kept for the recipe's own backward, which comes next
        needs = tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in packed.inputs)
        packed.rebuilt = packed.run_with_grad(packed.inputs, needs)
    return packed.rebuilt[1].detach()


@contextlib.contextmanager
def selective() -> Iterator[None]:
    """Selective mode for the forward inside: :func:`cheap` recomputes, and saved tensors tagged
    by it are packed as their recipes."""
    global _active
    _active += 1
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _active -= 1
