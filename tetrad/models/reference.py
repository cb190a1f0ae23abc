"""The single-process reference: the same Llama on plain ``torch.nn`` layers, full tensors.

Parameter names equal those of :class:`tetrad.models.llama.Llama`, so a parallel shard is
``shard.placement.shard_of(reference_param, grid)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.models.llama import ModelPart, Transformer, attend_causally_to
from tetrad.models.meta import materialize
from tetrad.models.moe import GroupedExperts
from tetrad.spec.model import ModelSpec


class PlainLayers:
    """Builds ``torch.nn`` layers; no head split."""

    head_split = 1
    stacked_pieces = 1

    def linear(
        self, k: int, n: int, *, transpose: bool = False, std: float = 0.02, stacked: int = 1
    ) -> nn.Module:
        layer = nn.Linear(k, n, bias=False)  # stacked: the global [s, n/s, k] as [n, k]
        layer.weight.init = ("normal", std)
        return layer

    def embedding(self, vocab: int, dim: int) -> nn.Module:
        return nn.Embedding(vocab, dim)

    def positions(self, s: int, device: torch.device) -> torch.Tensor:
        return torch.arange(s, device=device)

    def attend_to(self, k: torch.Tensor, v: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        return attend_causally_to(k, v)

    def head(self, dim: int, vocab: int) -> nn.Module:
        return self.linear(dim, vocab)

    def norm(self, dim: int, eps: float) -> nn.Module:
        return nn.RMSNorm(dim, eps=eps)

    def loss_sum(
        self,
        head: nn.Module,
        x: torch.Tensor,
        targets: torch.Tensor,
        vocab: int | None = None,
        grad_scale: float | None = None,
    ) -> torch.Tensor:
        logits = head(x)[..., :vocab]
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="sum")

    def head_norm(self, dim: int, eps: float) -> nn.Module:
        return nn.RMSNorm(dim, eps=eps)

    def router(self, dim: int, n_experts: int) -> nn.Module:
        return self.linear(dim, n_experts)

    def experts(self, n_experts: int, dim: int, ffn_dim: int, out_std: float) -> nn.Module:
        return GroupedExperts(n_experts, dim, ffn_dim, out_std)


class Llama(Transformer):
    """Plain Llama: tokens ``[B, S]`` -> logits ``[B, S, V]``; ``part``: a slice of it (a
    hand-split pipeline stage, as stock PyTorch users build one).

    Built on the meta device, then allocated on ``device`` (default: torch's default device;
    ``"meta"`` leaves it there), uninitialised (:mod:`tetrad.models.meta`): call
    :func:`tetrad.parallel.init_parameters` to get the same weights as any parallel run, or
    load a checkpoint.
    """

    def __init__(
        self,
        cfg: ModelSpec,
        activation_checkpointing: str | bool = "none",
        part: ModelPart | None = None,
        device: torch.device | str | None = None,
    ):
        device = torch.get_default_device() if device is None else device
        with torch.device("meta"):
            super().__init__(cfg, PlainLayers(), activation_checkpointing, part)
        materialize(self, device)
