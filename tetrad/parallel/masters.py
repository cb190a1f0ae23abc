"""Weights stored in bf16 with fp32 master weights in the optimizer and fp32 gradients.

Megatron-LM's mixed precision (Narayanan et al., arXiv 2104.04473; Micikevicius et al., arXiv
1710.03740, section 3.1, for the fp32 master copy): the model's parameters are stored in the
policy's ``params`` format (bf16) and read by forward and backward; each one's gradient is
accumulated apart, in the policy's ``grads`` format (fp32; Megatron's ``main_grad``), because
the parameter's own ``.grad`` must have the parameter's dtype; AdamW updates an fp32 master of
each parameter (:class:`MasterAdamW`; the sharded optimizer's masters are its pieces,
:class:`tetrad.parallel.zero.ShardedAdamW`), and the stored weights are refreshed from the
masters after every step.

Where the gradient lives: :func:`grad_of` is the one accessor the gradient plumbing
(:mod:`tetrad.parallel.grads`, ``buckets``, ``zero``, ``overlap``) reads; for a parameter stored
in its gradients' format it is ``param.grad``, unchanged. For the others,
:func:`store_parameters` registers a hook that moves what autograd accumulates in ``param.grad``
(norm weights, biases: one micro-batch's gradient, in bf16) into the fp32 accumulator, and the
layers whose weight gradient leaves backward through the overlap add it there directly in fp32
(:func:`add_grad`).
"""

from __future__ import annotations

import torch
from torch import nn

from tetrad.torch_private import foreach_copy_

MAIN_GRAD = "main_grad"
"""The attribute holding a parameter's gradient when it is kept apart (:func:`grad_of`)."""


def keeps_grad_apart(p: torch.Tensor) -> bool:
    """Whether ``p``'s gradient is kept apart from ``p.grad`` (in :data:`MAIN_GRAD`)."""
    return hasattr(p, "grad_dtype_apart")


def grad_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype ``p``'s gradient is accumulated in: the policy's ``grads`` format for a
    parameter stored in another (:func:`store_parameters`), else ``p``'s own."""
    return getattr(p, "grad_dtype_apart", p.dtype)


def reduce_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype ``p``'s gradient is summed over data in (the policy's ``grad_reduce``, set by
    :func:`store_parameters`; else :func:`grad_dtype`): the sum is cast back to
    :func:`grad_dtype`."""
    return getattr(p, "grad_reduce_dtype", grad_dtype(p))


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """``p``'s accumulated gradient (same shape as ``p``, :func:`grad_dtype`), or None."""
    return getattr(p, MAIN_GRAD) if keeps_grad_apart(p) else p.grad


def set_grad(p: torch.Tensor, g: torch.Tensor | None) -> None:
    """Make ``g`` (shaped as ``p``, in :func:`grad_dtype`, or None) ``p``'s gradient."""
    if keeps_grad_apart(p):
        setattr(p, MAIN_GRAD, g)
    else:
        p.grad = g


def add_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    """Accumulate ``g`` (shaped as ``p``, any float dtype) into ``p``'s gradient: taken as it
    is (cast to :func:`grad_dtype` if needed) when there is none yet, else added in place."""
    have = grad_of(p)
    if have is None:
        set_grad(p, g if g.dtype == grad_dtype(p) else g.to(grad_dtype(p)))
    else:
        have += g


def drop_grads(params) -> None:
    """Forget the gradients of ``params`` (``.grad`` and any kept apart)."""
    for p in params:
        p.grad = None
        if keeps_grad_apart(p):
            setattr(p, MAIN_GRAD, None)


def _move_grad(p: torch.Tensor) -> None:
    """After autograd accumulated into ``p.grad``: add it to the gradient kept apart (the hook
    also runs, with no gradient, for weights whose gradient leaves backward through the
    overlap)."""
    g, p.grad = p.grad, None
    if g is not None:
        add_grad(p, g)


@torch.no_grad()
def store_parameters(
    model: nn.Module, params: torch.dtype, grads: torch.dtype, reduce: torch.dtype | None = None
) -> None:
    """Store ``model``'s parameters in ``params`` (in place, ``param.data`` cast) and, where
    that is not ``grads``, keep their gradients apart in ``grads`` (:func:`grad_of`); sum them
    over data in ``reduce`` (default ``grads``; :func:`reduce_dtype`). Buffers keep their
    dtype. Idempotent."""
    for p in model.parameters():
        if reduce is not None and reduce != grads:
            p.grad_reduce_dtype = reduce
        if p.dtype != params:
            p.data = p.data.to(params)
        if params != grads and not keeps_grad_apart(p):
            p.grad_dtype_apart = grads
            setattr(p, MAIN_GRAD, None)
            p.register_post_accumulate_grad_hook(_move_grad)


def place_steps(optimizer: torch.optim.Optimizer) -> None:
    """Put every state's ``step`` where torch's own ``Optimizer.load_state_dict`` puts it: a
    0-dim fp32 tensor on its parameter's device in a fused or capturable group (their kernels
    read it there: torch's note "special device hosting for step"; a host ``step`` fails
    ``_fused_adamw_`` on CUDA), left as it is (on the host) otherwise. For states filled by a
    checkpoint load rather than by torch (:mod:`tetrad.train.checkpoint`)."""
    for group in optimizer.param_groups:
        if not (group.get("fused") or group.get("capturable")):
            continue
        for p in group["params"]:
            st = optimizer.state.get(p)
            if st and "step" in st:
                st["step"] = st["step"].to(device=p.device, dtype=torch.float32)


class MasterAdamW(torch.optim.AdamW):
    """torch's AdamW over fp32 masters of the parameters stored in another format (each
    parameter's own tensor where it is stored in ``master``).

    :meth:`step` gives each master its parameter's gradient (:func:`grad_of`, in fp32), runs
    AdamW on the masters and copies the updated masters back into the stored weights (rounded
    to their format). The masters are made from the parameters as they are when the optimizer
    is built: build it before the weights are cast (:func:`tetrad.train.step.build_optimizer`
    does both in that order). States: ``(4 + 2 * 4) n`` bytes for ``n`` elements with masters,
    ``2 * 4 n`` without.

    Attributes:
        pairs: ``(param, what AdamW updates for it)``: the parameter itself, or its master.

    Args:
        groups: parameter groups as for ``torch.optim.AdamW``.
        masters: keep fp32 masters (False: AdamW updates the parameters in place, as
            ``torch.optim.AdamW``; for :class:`tetrad.parallel.zero.ShardedAdamW`).
        **kwargs: ``lr``, ``betas``, ``eps``, ``fused``, ``foreach`` of ``torch.optim.AdamW``.
    """

    def __init__(self, groups: list[dict], masters: bool = True, **kwargs):
        self.masters = masters
        self.pairs: list[tuple[nn.Parameter, torch.Tensor]] = []
        inner = []
        for g in groups:
            views = []
            for p in g["params"]:
                v = self.target(p)
                self.pairs.append((p, v))
                views.append(v)
            inner.append({**g, "params": views})
        super().__init__(inner, **kwargs)

    def target(self, p: nn.Parameter) -> torch.Tensor:
        """What AdamW updates for ``p``: ``p`` itself, or a new master (an fp32 copy)."""
        return p.detach().to(torch.float32, copy=True) if self.masters else p

    def stored(self, p: nn.Parameter) -> torch.Tensor:
        """Where ``p``'s updated master is copied: ``p``'s data."""
        return p.data

    def gradient(self, p: nn.Parameter) -> torch.Tensor | None:
        """The gradient AdamW uses for ``p``'s target: its accumulated one."""
        return grad_of(p)

    @torch.no_grad()
    def step(self, closure=None):
        """AdamW on the targets, then the stored weights refreshed from the masters."""
        for p, v in self.pairs:
            if v is not p:
                g = self.gradient(p)
                v.grad = None if g is None else g.to(v.dtype)
        out = super().step(closure)
        self.write_back()
        return out

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy every master into its stored weight (one multi-tensor copy)."""
        pairs = [(self.stored(p), v) for p, v in self.pairs if v is not p]
        if pairs and self.masters:
            foreach_copy_([p for p, _ in pairs], [v for _, v in pairs])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the masters' gradients and the parameters' (kept apart or not)."""
        super().zero_grad(set_to_none)
        drop_grads(p for p, v in self.pairs)

    def master_of(self, p: nn.Parameter) -> torch.Tensor:
        """``p``'s target (its master, or ``p``)."""
        return dict((id(q), v) for q, v in self.pairs)[id(p)]

    def state_of(self, p: nn.Parameter) -> dict:
        """AdamW's state of ``p``'s target."""
        return self.state[self.master_of(p)]

    def full_states(self, params: list[nn.Parameter]) -> list[dict]:
        """For each of ``params``, ``{"step", "exp_avg", "exp_avg_sq", "master"}`` as whole
        local tensors (zeros before the first step; ``master`` the fp32 weights AdamW updates):
        what a checkpoint stores, whatever the stored format."""
        out = []
        for p in params:
            v = self.master_of(p)
            st = self.state[v]
            full = {"step": st.get("step", torch.tensor(0.0)), "master": v.detach()}
            for k in ("exp_avg", "exp_avg_sq"):
                full[k] = st[k] if k in st else torch.zeros_like(v)
            out.append(full)
        return out

    @torch.no_grad()
    def load_full_states(self, params: list[nn.Parameter], states: list[dict]) -> None:
        """Set the state and master of each of ``params`` from the whole local tensors in
        ``states`` (as :meth:`full_states` gives them), and the stored weights from the
        masters."""
        for p, full in zip(params, states, strict=True):
            v = self.master_of(p)
            st = self.state[v]
            st["step"] = full["step"]
            for k in ("exp_avg", "exp_avg_sq"):
                st[k] = full[k].to(v.dtype, copy=True)
            v.copy_(full["master"])
        place_steps(self)
        self.write_back()
