"""Mixture-of-experts feed-forward: a top-k router, dropless routed SwiGLU experts, an optional
shared expert, the load-balancing loss and DeepSeek-V3's aux-loss-free selection bias.

Written once over the layer factory (:class:`tetrad.models.llama.Layers`): the router comes from
``layers.router`` and the routed experts from ``layers.experts`` (:class:`GroupedExperts` in
the reference and, replicated, on the grid), so an expert-parallel runtime replaces only that
module (dispatch, expert GEMMs, combine). Nothing here knows the grid.

Per MoE block, tokens ``x [T, h]`` (``T = b s``, this rank's):

    router      logits = x G^T  [T, E];  s = softmax(logits) or sigmoid(logits) (fp32)
                ids = top-k(s + bias) [T, k]   (bias: aux-loss-free balancing, selection only)
                w = s[ids] (/ sum_k s[ids] when renormalised) * route_scale   [T, k] fp32
    experts     y_t = sum_j w_tj SwiGLU_{ids_tj}(x_t), SwiGLU_e(x) = W2_e (silu(W1_e x) * W3_e x)
    shared      y_t += SwiGLU_shared(x_t)   (when ``shared_ffn_dim``)

Sources: Mixtral (Jiang et al., arXiv 2401.04088, eq. 1-2; softmax over all E then top-k and
renormalise, as transformers' ``MixtralTopKRouter``), Qwen3-MoE (``norm_topk_prob``),
DeepSeek-V3 (arXiv 2412.19437, eq. 12-16: sigmoid scores, bias for selection only, weights from
the unbiased scores, ``route_scale``), the router z-loss (ST-MoE, arXiv 2202.08906, eq. 5). Not
implemented: DeepSeek-V3's group-limited routing, token dropping (capacity factors).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tetrad.dtypes import compute_dtype
from tetrad.spec.model import ModelSpec


class Router(nn.Module):
    """Top-k router: ``x [T, h]`` -> ``(ids [T, k] int64, weights [T, k] fp32, probs [T, E]
    fp32)``; ``probs`` are the per-token expert probabilities the load-balancing loss reads
    (softmax scores, or sigmoid scores divided by their sum, DeepSeek-V3 eq. 19).

    ``gate`` is ``layers.router(h, E)`` (weight ``[E, h]``). With ``cfg.bias_update_rate > 0``
    the buffer ``bias [E]`` (fp32, zeros) is added to the scores for the choice of experts only,
    and ``tokens_per_expert [E]`` (fp32, not saved) counts the token slots each expert received
    in training forwards since the last :meth:`update_bias`.
    """

    def __init__(self, cfg: ModelSpec, gate: nn.Module):
        super().__init__()
        self.gate, self.cfg = gate, cfg
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        if cfg.bias_update_rate > 0:
            self.register_buffer("bias", torch.zeros(cfg.n_experts))
            self.register_buffer("tokens_per_expert", torch.zeros(cfg.n_experts), persistent=False)
        else:
            self.bias = self.tokens_per_expert = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.route(x)[:3]

    def route(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`forward`'s ``(ids, weights, probs)`` and the router logits ``[T, E]`` fp32
        (for :func:`router_z_loss`)."""
        logits = self.gate(x).float()
        if self.cfg.router_score == "softmax":
            scores = torch.softmax(logits, dim=-1)
            probs = scores
        else:
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(-1, keepdim=True)
        choose = scores if self.bias is None else scores.detach() + self.bias
        ids = torch.topk(choose, self.top_k, dim=-1, sorted=True).indices
        weights = scores.gather(-1, ids)
        if self.cfg.router_renorm:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.cfg.route_scale != 1.0:
            weights = weights * self.cfg.route_scale
        if self.tokens_per_expert is not None and self.training and torch.is_grad_enabled():
            self.tokens_per_expert += expert_counts(ids, self.n_experts, torch.float32)
        return ids, weights, probs, logits

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """Aux-loss-free balancing (DeepSeek-V3, arXiv 2412.19437 section 2.1.2): raise the
        bias of experts that got fewer than the mean of ``counts [E]`` (token slots of the whole
        step, summed over every rank that saw other tokens) by ``gamma = bias_update_rate``,
        lower the others, then subtract the mean change so the biases stay zero-mean (as
        torchtitan's ``_update_expert_bias``). Only the sign of ``mean - count`` matters, so
        counts doubled by full activation recomputation give the same update. Resets
        ``tokens_per_expert``.
        """
        if self.bias is None:
            return
        delta = self.cfg.bias_update_rate * torch.sign(counts.float().mean() - counts.float())
        self.bias += delta - delta.mean()
        self.tokens_per_expert.zero_()


def load_balance_loss(
    probs: torch.Tensor,
    ids: torch.Tensor,
    n_experts: int,
    scope: str = "sequence",
    sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The Switch/GShard load-balancing loss (Fedus et al., arXiv 2101.03961, eq. 4-6), summed
    over groups of tokens: ``sum_g E sum_i f_gi P_gi`` with ``f_gi`` = token slots routed to
    expert ``i`` / ``(T_g k)`` and ``P_gi`` = mean probability of ``i`` over the group's ``T_g``
    tokens. Balanced routing gives 1 per group (Megatron's normalisation,
    ``switch_load_balancing_loss_func``; transformers' ``load_balancing_loss_func`` gives
    ``k``); DeepSeek-V3's sequence-wise loss (arXiv 2412.19437, eq. 17-20) is the same with one
    group per sequence.

    Args:
        probs: ``[b, s, E]`` fp32 per-token expert probabilities (:class:`Router`).
        ids: ``[b, s, k]`` chosen experts.
        scope: ``sequence`` (one group per sequence: the sum over this rank's ``b``
            sequences) or ``batch`` (one group of all ``b s`` tokens, counted ``b`` times, so
            that dividing by the global number of sequences averages either way).
        sequence_sum: where each rank holds a part of every sequence (context parallelism),
            the sum over those ranks of a tensor without gradient (the layer factory's
            ``sequence_sum``): the slot counts become the whole sequences', and each rank adds
            its own tokens' probabilities divided by the whole length, so that the ranks'
            losses add up to the loss of the whole sequences (and their gradients are exact
            with no collective in backward). None: this rank holds whole sequences.

    Returns:
        A 0-dim fp32 tensor; differentiable through ``probs`` (``f`` is a count).
    """
    b, s, k = ids.shape
    if scope == "batch":
        probs, ids = probs.reshape(1, b * s, -1), ids.reshape(1, b * s, k)
    groups, tokens = ids.shape[:2]
    slots = torch.zeros(groups, n_experts, device=ids.device)
    slots.scatter_add_(
        1, ids.reshape(groups, -1), torch.ones(groups, tokens * k, device=ids.device)
    )
    if sequence_sum is None:
        f, p = slots / (tokens * k), probs.mean(1)
    else:  # slots summed over the sequence's parts; then slots.sum(-1) = whole length x k
        slots = sequence_sum(slots)
        length = slots.sum(-1, keepdim=True) / k
        f, p = slots / (length * k), probs.sum(1) / length
    per_group = n_experts * (f * p).sum(-1)
    return per_group.sum() * (b if scope == "batch" else 1)


def router_z_loss(logits: torch.Tensor, parts: int = 1) -> torch.Tensor:
    """The router z-loss (ST-MoE, Zoph et al., arXiv 2202.08906, eq. 5: the mean over tokens
    of ``(log sum_i exp(logit_i))^2``), as a sum over this rank's ``b`` sequences of each
    sequence's mean, so that dividing by the global number of sequences gives the mean over
    every token (all sequences have the same length). It keeps the router logits small, where
    the softmax and its round-off stay tame.

    Args:
        logits: ``[b, s, E]`` router logits (:meth:`Router.route`), this rank's ``s``
            positions of each sequence.
        parts: the equal parts each sequence is cut into over the ranks (the layer factory's
            ``sequence_parts``, ``G_context G_y G_x``; 1: whole sequences): each rank's share
            is its own tokens' squares over the whole length ``s parts``, so the shares add up
            to the whole sequences' loss with exact local gradients and no collective.

    Returns:
        A 0-dim fp32 tensor, differentiable through ``logits``.
    """
    s = logits.shape[1]
    return torch.logsumexp(logits.float(), dim=-1).square().sum() / (s * parts)


def expert_counts(
    ids: torch.Tensor, n_experts: int, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """The token slots per expert, ``[E]`` in ``dtype``, of the chosen experts ``ids`` (any
    shape, values in ``[0, E)``). A ``scatter_add`` into ``E`` zeros: the output's size is
    known without reading ``ids``, so no host synchronisation (``torch.bincount`` reads the
    largest id first: two device-to-host copies per call on CUDA)."""
    flat = ids.flatten()
    counts = torch.zeros(n_experts, dtype=dtype, device=ids.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=dtype))


def sort_by_expert(ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``T k`` token slots of ``ids [T, k]`` in expert order: ``(order [T k], counts [E])``
    where ``order`` lists flat slot indices (slot ``t k + j`` is token ``t``'s ``j``-th choice),
    stably sorted by expert (deterministic), and ``counts`` the slots per expert (int64).
    No host synchronisation."""
    order = torch.argsort(ids.flatten(), stable=True)
    return order, expert_counts(ids, n_experts)


class _PutRows(torch.autograd.Function):
    """``out[index[i]] = x[i]``; backward gathers ``grad[index]``, keeping only ``index``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        return x.new_empty(x.shape).index_copy_(0, index, x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None


def put_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The rows of ``x [N, ...]`` put at the places ``index [N]`` (a permutation of ``0..N-1``)
    says: ``out[index[i]] = x[i]``, i.e. ``x[argsort(index)]`` without sorting for the inverse
    (deterministic, no atomics); its backward is the gather ``grad[index]`` and keeps ``index``
    alone (autograd's ``index_copy`` would keep ``x`` too, a gather with the inverse's
    ``index_put`` backward a zero-filled tensor of ``x``'s shape)."""
    return _PutRows.apply(x, index)


def combine(
    ys: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The routed output ``[T, h]`` in ``dtype`` from the expert outputs ``ys [T k, h]`` of the
    slots in expert order (``order`` from :func:`sort_by_expert`) and the routing weights
    ``weights [T, k]`` (fp32): each slot times its weight in ``ys``'s dtype (the compute
    dtype), put back in token order (:func:`put_rows`), the ``k`` slots of a token summed in
    fp32 (float64 in a float64 run).

    In bf16 the weight and the product are rounded to bf16 (``2**-8`` each, bf16's unit
    roundoff) where the fp32 path multiplied the same bf16 outputs by the fp32 weights: each
    slot's term is within ``2**-7`` of that path's, relative (tests/test_moe.py), as
    Megatron-LM's unpermute and torchtitan's combine multiply in the tokens' dtype. What it
    saves: autograd keeps ``ys`` in bf16 ``[T k, h]`` instead of an fp32 copy, half the bytes,
    and the weights ``[T k, 1]`` in bf16."""
    t, k = weights.shape
    weighted = ys * weights.flatten()[order, None].to(ys.dtype)
    back = put_rows(weighted, order)  # slot order: token t's k slots adjacent
    total = torch.promote_types(ys.dtype, torch.float32)  # fp32, or float64 in float64 runs
    return back.view(t, k, -1).sum(1, dtype=total).to(dtype)


def can_grouped_mm(x: torch.Tensor, *dims: int) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` runs on ``x`` with these inner sizes: the
    function exists (torch >= 2.10), a CPU tensor or a CUDA device of compute capability 8.0 or
    more, bf16/fp16/fp32, and every row stride a multiple of 16 bytes
    (``aten/src/ATen/native/GroupedMMUtils.h``)."""
    if not hasattr(F, "grouped_mm") or x.dtype not in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
    ):
        return False
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] < 8:
        return False
    if x.device.type not in ("cpu", "cuda"):
        return False
    return all(d * x.element_size() % 16 == 0 for d in dims)


def expert_swiglu(
    xs: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    grouped: bool | None = None,
) -> torch.Tensor:
    """SwiGLU of each expert on its rows: ``xs [N, h]`` sorted by expert (``counts [E]`` rows
    each, summing to ``N``), ``w1, w3 [E, F, h]``, ``w2 [E, h, F]`` -> ``[N, h]`` in
    ``xs``'s dtype.

    ``grouped``: use ``F.grouped_mm`` (one kernel per weight, ``offs`` = int32 group ends;
    empty groups allowed) or a loop of per-expert GEMMs; None: grouped where
    :func:`can_grouped_mm`. Both give the same values in fp32 (tests/test_moe.py).
    """
    if grouped is None:
        grouped = can_grouped_mm(xs, w1.shape[-1], w1.shape[-2])
    if torch.compiler.is_compiling() and not (grouped and xs.dtype == torch.bfloat16):
        # torch.compile traces grouped_mm in bf16 only (its meta function refuses fp32), and
        # the loop's sizes are this step's counts (a recompile each step): the experts then
        # run eagerly, one graph break, the rest of the block compiled
        return _expert_swiglu_eager(xs, counts, w1, w3, w2, grouped)
    if grouped:  # no host synchronisation (on CUDA before SM90 torch's fallback reads offs)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        gate = F.grouped_mm(xs, w1.transpose(-2, -1), offs=offs)
        up = F.grouped_mm(xs, w3.transpose(-2, -1), offs=offs)
        return F.grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):  # a host read of the counts: the loop's sizes
        rows = xs[start : start + n]
        outs.append((F.silu(rows @ w1[e].t()) * (rows @ w3[e].t())) @ w2[e].t())
        start += n
    return torch.cat(outs) if outs else xs.new_zeros(0, w2.shape[1])


_expert_swiglu_eager = torch.compiler.disable(expert_swiglu)


class GroupedExperts(nn.Module):
    """``E`` routed SwiGLU experts, dropless, on one rank: ``(x [T, h], ids [T, k], weights
    [T, k] fp32)`` -> ``[T, h]`` in ``x``'s dtype (the compute dtype under autocast).

    Weights in torchtitan's layout: ``w1, w3 [E, F, h]`` (gate, up), ``w2 [E, h, F]`` (down),
    initialised ``normal(0, 0.02)`` and ``normal(0, out_std)``.

    Dispatch: the ``T k`` slots are sorted by expert (:func:`sort_by_expert`) and their tokens
    gathered; the expert GEMMs run grouped (:func:`expert_swiglu`); combine multiplies each
    slot by its routing weight in fp32 and puts the slots back in token order (a permutation:
    deterministic, no atomics), then sums each token's ``k`` slots.
    An expert-parallel version keeps this interface and sends the sorted rows to the experts'
    ranks between the sort and the GEMMs (all-to-all), and back before the combine.
    """

    def __init__(self, n_experts: int, dim: int, ffn_dim: int, out_std: float = 0.02):
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        self.w1.init = self.w3.init = ("normal", 0.02)
        self.w2.init = ("normal", out_std)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k = ids.shape[1]
        order, counts = sort_by_expert(ids, self.n_experts)
        dtype = compute_dtype(x)
        xs = x.to(dtype)[order // k]
        w1, w3, w2 = (w.to(dtype) for w in (self.w1, self.w3, self.w2))
        ys = expert_swiglu(xs, counts, w1, w3, w2)
        return combine(ys, order, weights, dtype)

    def extra_repr(self) -> str:
        e, f, h = self.w1.shape
        return f"{e} experts, {h}->{f}->{h}"


class MoEFeedForward(nn.Module):
    """The MoE feed-forward of one block: ``x [b, s, h]`` -> ``[b, s, h]`` (see the module
    docstring), with the shared expert when ``cfg.shared_ffn_dim``.

    After each forward with grad, :attr:`aux_loss` holds ``aux_loss_coef`` x
    :func:`load_balance_loss` plus ``router_z_loss_coef`` x :func:`router_z_loss` of its tokens
    (a 0-dim fp32 tensor, a sum over this rank's sequences: divide by the global number of
    sequences; None when both coefficients are 0). The
    training step adds it to the loss (:meth:`tetrad.models.llama.Transformer.aux_loss_sum`).
    :attr:`routing` holds the forward's routing statistics, ``[E + 2]`` fp32 without gradient
    (None without grad): the token slots this rank's tokens sent to each of the ``E`` experts
    (:func:`expert_counts`), then this rank's shares of :func:`load_balance_loss` and of
    :func:`router_z_loss` (coefficients left out; 0 where a coefficient is 0). Summed over the
    micro-batches of a step
    (:meth:`tetrad.models.llama.Transformer.record_routing`) and over the ranks that route
    other tokens, they give the step's loads and balance term (:func:`routing_figures`).

    When the layer factory has ``moe_tokens`` (not None), the router, the experts and the
    load-balancing statistics run on ``moe_tokens.split(x)`` (``[b, s', h']``: on a
    tensor-parallel grid this rank's share of the tokens, whole), the routed output goes back
    through ``moe_tokens.join`` and :attr:`aux_loss` through ``moe_tokens.total``; the shared
    expert takes ``x`` as it is.
    """

    def __init__(self, cfg: ModelSpec, layers, shared: nn.Module | None):
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg, layers.router(cfg.dim, cfg.n_experts))
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        self.experts = layers.experts(cfg.n_experts, cfg.dim, cfg.expert_dim, out_std)
        self.shared = shared
        self.sequence_sum = getattr(layers, "sequence_sum", None)
        self.sequence_parts = getattr(layers, "sequence_parts", 1)
        self.tokens = getattr(layers, "moe_tokens", None)
        self.aux_loss: torch.Tensor | None = None
        self.routing: torch.Tensor | None = None
        self.routing_sum: torch.Tensor | None = None  # Transformer.record_routing's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = x if self.tokens is None else self.tokens.split(x)
        b, s, h = routed.shape
        flat = routed.reshape(b * s, h)
        ids, weights, probs, logits = self.router.route(flat)
        y = self.experts(flat, ids, weights).view(b, s, h)
        self.aux_loss = self.routing = None
        if torch.is_grad_enabled():
            balance = z = torch.zeros((), device=x.device)
            aux = []
            if self.cfg.aux_loss_coef > 0:
                balance = load_balance_loss(
                    probs.view(b, s, -1),
                    ids.view(b, s, -1),
                    self.cfg.n_experts,
                    self.cfg.aux_loss_scope,
                    self.sequence_sum,
                )
                aux.append(self.cfg.aux_loss_coef * balance)
            if self.cfg.router_z_loss_coef > 0:
                z = router_z_loss(logits.view(b, s, -1), self.sequence_parts)
                aux.append(self.cfg.router_z_loss_coef * z)
            if aux:
                self.aux_loss = aux[0] if len(aux) == 1 else aux[0] + aux[1]
                if self.tokens is not None:
                    self.aux_loss = self.tokens.total(self.aux_loss)
            counts = expert_counts(ids, self.cfg.n_experts, torch.float32)
            terms = torch.stack([balance.detach().float(), z.detach().float()])
            self.routing = torch.cat([counts, terms])
        if self.tokens is not None:
            y = self.tokens.join(y)
        return y if self.shared is None else y + self.shared(x)


def routing_figures(
    stats: torch.Tensor, sequences: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The balance of a step's routing from its statistics ``stats [..., E + 2]``
    (:attr:`MoEFeedForward.routing` summed over every rank and micro-batch) and the step's
    ``sequences`` (the global batch): ``(max_load [...], balance [...], z_loss [...])``.

    ``max_load`` = the slots of the busiest expert over the mean slots per expert (1 balanced,
    ``E/k`` when every token picks the same ``k`` experts). ``balance`` = the block's
    load-balancing term divided by its coefficient, a mean over the sequences of
    :func:`load_balance_loss` (Megatron's normalisation, ``switch_load_balancing_loss_func``:
    1 balanced, up to ``E/k`` collapsed; 0 when the coefficient is 0). ``z_loss`` = the block's
    :func:`router_z_loss`, the mean over the step's tokens of the squared log-sum-exp of the
    router logits (its coefficient left out; 0 when the coefficient is 0).
    """
    counts = stats[..., :-2]
    mean = counts.mean(-1).clamp_min(torch.finfo(counts.dtype).tiny)
    return counts.amax(-1) / mean, stats[..., -2] / sequences, stats[..., -1] / sequences
