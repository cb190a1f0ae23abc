"""A stock PyTorch expert-parallel MoE layer, written the way torchtitan's
``AllToAllTokenDispatcher`` and ``GroupedExperts`` do it (torchtitan ``models/common/moe.py``,
``models/common/token_dispatcher.py``), for ``benchmarks/moe.py`` to compare tetrad's with.

Plain ``nn.Module``: a bias-free router ``nn.Linear``, softmax top-k renormalised; per-expert
counts by ``bincount``; the ``T k`` slots argsorted by expert; an ``all_to_all_single`` of the
counts, the split sizes read on the host, the token rows exchanged with the functional
``all_to_all_single_autograd``; rows permuted rank-major -> expert-major, three
``torch.nn.functional.grouped_mm`` (a loop of per-expert GEMMs where it cannot run); back the
same way; the routing weights applied in fp32 and the slots summed into ``[T, h]`` with
``scatter_add`` (torchtitan's ``combine``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn


class StockExpertParallelMoE(nn.Module):
    """Router and ``E/P`` local experts of an MoE layer on an expert group ``group`` of ``P``
    ranks: ``x [T, h]`` -> ``[T, h]``. Weights ``w1, w3 [E/P, F, h]``, ``w2 [E/P, h, F]``."""

    def __init__(self, n_experts: int, dim: int, ffn: int, top_k: int, group, grouped: bool):
        super().__init__()
        self.group, self.p = group, dist.get_world_size(group)
        self.n_experts, self.top_k, self.grouped = n_experts, top_k, grouped
        local = n_experts // self.p
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(local, ffn, dim))
        self.w3 = nn.Parameter(torch.empty(local, ffn, dim))
        self.w2 = nn.Parameter(torch.empty(local, dim, ffn))

    def experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The local experts on rows sorted by expert (``counts [E/P]`` rows each)."""
        if self.grouped:
            offs = torch.cumsum(counts, 0).to(torch.int32)
            h = F.silu(F.grouped_mm(x, self.w1.transpose(-2, -1), offs=offs))
            h = h * F.grouped_mm(x, self.w3.transpose(-2, -1), offs=offs)
            return F.grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)
        outs = []
        for e, rows in enumerate(torch.split(x, counts.tolist())):
            outs.append((F.silu(rows @ self.w1[e].t()) * (rows @ self.w3[e].t())) @ self.w2[e].t())
        return torch.cat(outs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, k, p = x.shape[0], self.top_k, self.p
        scores = torch.softmax(self.gate(x).float(), dim=-1)
        top, ids = torch.topk(scores, k, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        flat = ids.flatten()
        counts = torch.bincount(flat, minlength=self.n_experts)
        order = torch.argsort(flat, stable=True)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)
        recv = recv.view(p, -1)
        send_splits = counts.view(p, -1).sum(1).tolist()
        recv_splits = recv.sum(1).tolist()
        rows = funcol.all_to_all_single_autograd(
            x[order // k], recv_splits, send_splits, self.group
        )
        rows = funcol.wait_tensor(rows)
        # rank-major -> expert-major (torchtitan: generate_permute_indices)
        src = torch.arange(p).repeat_interleave(recv.shape[1])
        expert = torch.arange(recv.shape[1]).repeat(p)
        block = torch.repeat_interleave(expert * p + src, recv.flatten())
        perm = torch.argsort(block, stable=True)
        ys = self.experts(rows[perm], recv.sum(0))
        back = torch.empty_like(ys).index_copy(0, perm, ys)
        home = funcol.wait_tensor(
            funcol.all_to_all_single_autograd(back, send_splits, recv_splits, self.group)
        )
        weighted = home.float() * top.flatten()[order, None]
        token = (order // k)[:, None].expand(-1, x.shape[1])
        return torch.zeros(t, x.shape[1]).scatter_add(0, token, weighted).to(x.dtype)
