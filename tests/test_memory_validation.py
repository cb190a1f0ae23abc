"""The planner's model of tetrad's memory against what the runtime really allocates and saves.

On gloo ranks (CPU, fp32), for several grids, each rank measures:

- parameter bytes: the sum of its local parameters' ``nbytes``;
- gradient bytes: the sum of ``.grad`` ``nbytes`` after one micro-batch's backward;
- optimizer-state bytes: AdamW's ``exp_avg`` + ``exp_avg_sq`` after one ``train_step`` (the
  ``step`` counters are 0-d host tensors, not counted by the model: checked here), and the
  same with the sharded optimizer (``shard_optimizer``: this rank's pieces);
- activation bytes: unique storages passed to ``torch.autograd.graph.saved_tensors_hooks`` during
  one micro-batch's forward as training runs it (the loss's gradient given, ``grad_scale``:
  with ``G_z = 1`` the LM head's ``dW`` goes into its gradient, nothing saved), parameters
  excluded, in each checkpointing mode (``none``,
  ``selective``, ``selective:1``, ``full``); under ``selective`` the blocks' kept tensors are
  those that :mod:`tetrad.models.recompute`'s own pack hook keeps (its ``observer``: an outer
  hook does not see them); with ``full`` also the recompute set: one block's saved storages minus
  its input; and the same forward under CPU bf16 autocast (the runtime's Linears follow
  autocast; plain ``torch.autocast``, so an fp32 residual stream), against the model's bf16
  estimate with ``residual="fp32"``; and under the step's autocast with the CUDA policy (fp32
  weights, bf16 GEMMs, the bf16 residual stream of ``--residual-dtype auto``), in every mode
  (with ``full`` its recompute set too), against the model's bf16 estimate;
- with the weights stored in bf16 (``--param-dtype bf16``, fp32 masters in the optimizer): the
  parameters, the fp32 gradients kept apart after one micro-batch's backward, the states with
  the masters (sharded and not), and the saved bytes of one forward (the step's autocast: a
  bf16 residual stream), against ``runtime_memory(..., params="bf16")``.

Model states and activations must equal :func:`tetrad.plan.memory.runtime.tetrad` and
:func:`tetrad.plan.memory.activations.saved_activations` to the byte.
"""

import contextlib
import json

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tetrad.dtypes import autocast, residual_dtype
from tetrad.grid import Grid
from tetrad.models import recompute
from tetrad.parallel import init_parameters
from tetrad.parallel.batch import inputs_targets, local_samples
from tetrad.parallel.masters import grad_of
from tetrad.parallel.model import ParallelLlama, compile_blocks
from tetrad.plan.memory.activations import compiled_block_delta, saved_activations
from tetrad.plan.memory.runtime import runtime_memory
from tetrad.spec.activation_checkpointing import checkpointed_blocks
from tetrad.spec.model import ModelSpec
from tetrad.spec.precision import precision
from tetrad.train.step import build_optimizer, train_step

CFG = ModelSpec(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256)
MICRO, SEQ, SEED = 2, 16, 3
GRIDS = {  # (G_data, G_z, G_y, G_x) or (G_data, G_context, G_z, G_y, G_x)
    1: [(1, 1, 1, 1)],
    4: [(1, 2, 1, 2), (2, 1, 2, 1), (1, 2, 1, 1, 2)],
    8: [(1, 2, 2, 2), (2, 2, 1, 2, 1), (1, 4, 1, 1, 2)],
}
# sequence parallelism (tetrad/parallel/sequence.py): data x Y, context x Y, Y x X
SEQUENCE_PARALLEL_GRIDS = {4: [(2, 1, 2, 1), (1, 2, 1, 2, 1), (1, 1, 2, 2)]}
# and the first Linears' inputs kept split, gathered again in backward (Y x X; activations only)
REGATHER_GRIDS = {4: [(1, 1, 2, 2)]}
SUFFIX = {False: "", True: "_sp", "regather": "_sp_regather"}
MODES = ("none", "selective", "selective:1", "full")  # selective:1: the top block only


class SavedBytes:
    """Sum of the unique storages autograd saves inside the context, minus excluded ones."""

    def __init__(self, exclude: set[int]):
        self.exclude, self.seen = exclude, {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in self.exclude:
            self.seen[st.data_ptr()] = st.nbytes()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._ctx.__enter__()
        recompute.observer = self.pack
        return self

    def __exit__(self, *exc):
        recompute.observer = None
        self._ctx.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def block_recompute_bytes(
    model, tokens: torch.Tensor, params: set[int], block: str = "0", policy=None
) -> int:
    """Saved bytes of one block's forward as full checkpointing's recomputation runs it (block
    ``block``, on the embedding of ``tokens``), its input excluded; under the step's autocast
    with ``policy`` when given."""
    step = autocast(tokens.device, policy) if policy is not None else contextlib.nullcontext()
    with step:
        with torch.no_grad():
            x = _embedded(model, tokens)
        x.requires_grad_(True)
        with SavedBytes(params | {x.untyped_storage().data_ptr()}) as saved:
            model.layers[block](x, model.layer_factory.positions(tokens.shape[1], x.device))
    return saved.total


def _embedded(model, tokens: torch.Tensor) -> torch.Tensor:
    """The residual stream's first tensor: the embedding of ``tokens`` in the active policy's
    residual format (as ``Transformer.hidden`` casts it)."""
    h = model.tok_embeddings(tokens)
    return h.to(residual_dtype(h.device, model.tok_embeddings.weight.dtype))


def forward_and_backward_bytes(model, tokens, targets, params: set[int]) -> dict:
    """Parameter bytes, the saved bytes of one forward in fp32 and under CPU bf16 autocast, and
    the gradient bytes after the fp32 forward's backward."""
    out = {"parameters": sum(p.numel() * p.element_size() for p in model.parameters())}
    with SavedBytes(params) as saved:
        loss = model.loss_sum(tokens, targets, grad_scale=1.0)
    out["activations"] = saved.total
    with SavedBytes(params) as saved_bf16, torch.autocast("cpu", dtype=torch.bfloat16):
        model.loss_sum(tokens, targets, grad_scale=1.0)
    out["activations_bf16"] = saved_bf16.total
    with SavedBytes(params) as saved_stream, autocast(tokens.device, precision("cuda")):
        model.loss_sum(tokens, targets, grad_scale=1.0)
    out["activations_bf16_stream"] = saved_stream.total
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    out["gradients"] = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    return out


def _runs(world_size: int) -> list[tuple[tuple, bool | str]]:
    """``(sizes, sequence_parallel)`` measured on ``world_size`` ranks (``"regather"``: with
    ``sequence_parallel_regather``)."""
    runs = [(s, False) for s in GRIDS[world_size]]
    runs += [(s, True) for s in SEQUENCE_PARALLEL_GRIDS.get(world_size, [])]
    return runs + [(s, "regather") for s in REGATHER_GRIDS.get(world_size, [])]


def _measure(grid: Grid, mode: str, sequence_parallel: bool | str = False) -> dict:
    regather = sequence_parallel == "regather"
    model = ParallelLlama(
        CFG,
        grid,
        mode,
        sequence_parallel=bool(sequence_parallel),
        sequence_parallel_regather=regather,
    )
    init_parameters(model, SEED, grid)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    g = torch.Generator().manual_seed(SEED)
    batch = torch.randint(0, CFG.vocab_size, (MICRO * grid.batch_shards, SEQ + 1), generator=g)
    mb = local_samples(batch, grid)
    tokens, targets = inputs_targets(mb, grid)
    out = forward_and_backward_bytes(model, tokens, targets, params)

    if mode == "full":
        out["recompute"] = block_recompute_bytes(model, tokens, params)
        cuda = precision("cuda")  # fp32 weights, bf16 GEMMs and residual stream
        out["recompute_bf16_stream"] = block_recompute_bytes(model, tokens, params, policy=cuda)

    if mode != "none" or regather:  # AdamW's states: measured once per grid
        return out
    model.zero_grad(set_to_none=True)
    opt = build_optimizer(model, 1e-3, weight_decay=0.1)
    train_step(model, opt, grid, batch, MICRO, 1.0)
    states = [opt.state[p] for p in model.parameters()]
    assert all(s["step"].dim() == 0 and s["step"].device.type == "cpu" for s in states)
    out["optimizer_states"] = sum(
        s[k].numel() * s[k].element_size() for s in states for k in ("exp_avg", "exp_avg_sq")
    )
    model.zero_grad(set_to_none=True)  # the sharded optimizer: its pieces' states
    opt = build_optimizer(model, 1e-3, weight_decay=0.1, shard=grid)
    train_step(model, opt, grid, batch, MICRO, 1.0)
    states = [opt.state_of(p) for p in model.parameters()]
    out["optimizer_states_sharded"] = sum(
        s[k].numel() * s[k].element_size() for s in states for k in ("exp_avg", "exp_avg_sq")
    )
    model.zero_grad(set_to_none=True)
    return out | _measure_bf16_storage(model, grid, batch, tokens, targets)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _measure_bf16_storage(model, grid, batch, tokens, targets) -> dict:
    """The model states and saved bytes with the weights stored in bf16 (the optimizer's
    masters made from ``model``'s fp32 weights, which it then casts)."""
    bf16 = precision("cpu", "bf16")
    opt = build_optimizer(model, 1e-3, weight_decay=0.1, policy=bf16)
    out = {"parameters_bf16": nbytes(model.parameters())}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with SavedBytes(params) as saved, autocast(grid.device, bf16):
        loss = model.loss_sum(tokens, targets, grad_scale=1.0)
    out["activations_bf16_storage"] = saved.total
    loss.backward()
    assert all(p.grad is None and grad_of(p) is not None for p in model.parameters())
    out["gradients_bf16"] = nbytes(grad_of(p) for p in model.parameters())
    opt.zero_grad()
    for key, shard in (("optimizer_states_bf16", None), ("optimizer_states_sharded_bf16", grid)):
        if shard is not None:
            opt = build_optimizer(model, 1e-3, weight_decay=0.1, shard=shard, policy=bf16)
        train_step(model, opt, grid, batch, MICRO, 1.0)
        states = [opt.state_of(p) for p in model.parameters()]
        moments = [s[k] for s in states for k in ("exp_avg", "exp_avg_sq")]
        out[key] = nbytes(moments) + nbytes(opt.master_of(p) for p in model.parameters())
    return out


def _worker(world_size: int, out_dir: str) -> None:
    rank = dist.get_rank()
    for sizes, sp in _runs(world_size):
        grid = Grid.build(sizes)
        for mode in MODES:
            result = _measure(grid, mode, sp)
            name = f"{'-'.join(map(str, sizes))}{SUFFIX[sp]}_{mode}_{rank}.json"
            with open(f"{out_dir}/{name}", "w") as fh:
                json.dump(result, fh)


def predicted(sizes, mode: str, sp: bool | str = False) -> dict:
    spec = CFG
    opts = {"activation_checkpointing": mode, "dtype": "fp32", "sequence_parallel": sp}
    r = runtime_memory(spec, sizes, MICRO, SEQ, 1e9, **opts)
    s = saved_activations(spec, sizes, MICRO, SEQ, **opts)
    out = {k: r.components[k] for k in ("parameters", "gradients", "optimizer_states")}
    zero = runtime_memory(spec, sizes, MICRO, SEQ, 1e9, dtype="fp32", shard_optimizer=True)
    out["optimizer_states_sharded"] = zero.components["optimizer_states"]
    for key, shard in (("optimizer_states", False), ("optimizer_states_sharded", True)):
        kw = {"dtype": "bf16", "params": "bf16", "shard_optimizer": shard}
        r16 = runtime_memory(spec, sizes, MICRO, SEQ, 1e9, **kw).components
        out[f"{key}_bf16"] = r16["optimizer_states"]
        if not shard:
            out["parameters_bf16"], out["gradients_bf16"] = r16["parameters"], r16["gradients"]
    out["activations"] = s["blocks"] + s["embedding"] + s["final_norm"] + s["loss"]
    if mode == "full":
        out["recompute"] = s["recompute"]
    # bf16 autocast on CPU: the model's "bf16" describes CUDA, where FlashAttention returns its
    # output token-major; the CPU kernel returns it heads-major, so each block also saves the
    # out-projection input [m, a d/G_y] as a bf16 copy (selective rebuilds it instead).
    plain_blocks = spec.n_layers - checkpointed_blocks(mode, spec.n_layers)[1]
    copies = len(sizes) == 4  # with context: token-major, in the model
    cpu_copy = plain_blocks * 2 * MICRO * SEQ * spec.q_dim // sizes[2] if copies else 0
    # and with context parallelism the CPU's additive bf16 masks, shared by the blocks (CUDA's
    # lower-right CausalBias is no tensor: tetrad/parallel/context.py)
    gc = sizes[1] if len(sizes) == 5 else 1
    masks = 2 * (SEQ // (2 * gc)) ** 2 * (2 * gc + 1) if gc > 1 else 0
    cpu_copy += masks if mode != "full" else 0
    for key, residual in (("activations_bf16", "fp32"), ("activations_bf16_stream", None)):
        b = saved_activations(
            spec, sizes, MICRO, SEQ, **(opts | {"dtype": "bf16"}), residual=residual
        )
        out[key] = b["blocks"] + b["embedding"] + b["final_norm"] + b["loss"] + cpu_copy
        if mode == "full" and residual is None:  # one block rebuilt: no copy saved in the model
            block_copy = 2 * MICRO * SEQ * spec.q_dim // sizes[2] if copies else 0
            block_copy += masks  # saved by the recomputed block
            out["recompute_bf16_stream"] = b["recompute"] + block_copy
    # weights bf16 (the step's autocast, a bf16 stream): the same saved as fp32 weights
    out["activations_bf16_storage"] = out["activations_bf16_stream"]
    return out


@pytest.mark.parametrize("world_size", sorted(GRIDS))
def test_memory_model_matches_runtime(world_size, tmp_path):
    run_distributed(_worker, world_size, world_size, str(tmp_path))
    for sizes, sp in _runs(world_size):
        for mode in MODES:
            want = predicted(sizes, mode, sp)
            label = f"grid {sizes}{SUFFIX[sp].replace('_', ' ')} {mode}"
            for rank in range(world_size):
                name = f"{'-'.join(map(str, sizes))}{SUFFIX[sp]}_{mode}_{rank}.json"
                got = json.loads((tmp_path / name).read_text())
                line = ", ".join(f"{k} {got[k]}/{want[k]:.0f}" for k in want if k in got)
                if rank == 0:
                    print(f"{label} measured/predicted bytes: {line}")
                for k in want:
                    if k in got:
                        assert got[k] == want[k], f"{label} rank {rank} {k}: {line}"


COMPILED_MODES = ("none", "selective", "full")


def _compiled_worker(out_dir: str) -> None:
    """One rank: each mode's forward with the blocks under ``torch.compile`` (fp32, and bf16
    autocast without checkpointing): saved bytes, and under ``full`` one block's recompute set.
    Forward only: the backward graphs are never compiled (they would add minutes, not bytes).

    The models are built one after another in this process, ``full`` after ``selective``, as
    :func:`_assert_no_frame_per_cheap_function` needs; their losses are the same."""
    grid = Grid.build((1, 1, 1, 1))
    losses = []
    for mode in COMPILED_MODES:
        model = ParallelLlama(CFG, grid, mode)
        init_parameters(model, SEED, grid)
        compile_blocks(model)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        g = torch.Generator().manual_seed(SEED)
        batch = torch.randint(0, CFG.vocab_size, (MICRO, SEQ + 1), generator=g)
        tokens, targets = inputs_targets(local_samples(batch, grid), grid)
        out = {}
        with SavedBytes(params) as saved:
            losses.append(model.loss_sum(tokens, targets, grad_scale=1.0).detach())
        out["activations"] = saved.total
        if mode == "none":
            with SavedBytes(params) as saved, torch.autocast("cpu", dtype=torch.bfloat16):
                model.loss_sum(tokens, targets, grad_scale=1.0)
            out["activations_bf16"] = saved.total
        if mode == "full":
            out["recompute"] = block_recompute_bytes(model, tokens, params)
        with open(f"{out_dir}/compiled_{mode}.json", "w") as fh:
            json.dump(out, fh)
    for loss in losses[1:]:
        torch.testing.assert_close(loss, losses[0])
    _assert_no_frame_per_cheap_function()


def _assert_no_frame_per_cheap_function() -> None:
    """Dynamo inlined the cheap functions into the blocks' graphs (``none``, ``full``) or broke
    the graph at the eager recomputation (``selective``), in the calling frame, guarded on the
    mode: none of them, nor the helper that runs them, was compiled as a frame of its own once
    per function (torch 2.13 went past its recompile limit; torch 2.11 gave the keys the
    queries' graph), neither in selective mode nor in a model built after it (which reused the
    selective blocks' entries). ``tetrad.models.recompute.runner``."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from tetrad.models import recompute
    from tetrad.models.llama import Attention, swiglu
    from tetrad.parallel.norm import normalise

    own_frames = [recompute.cheap, recompute._plain, swiglu, normalise, Attention._merge_heads]
    own_frames += [Attention._rotated_queries, Attention._rotated_keys, Attention._values]
    compiled = {f.__name__: len(_debug_get_cache_entry_list(f.__code__)) for f in own_frames}
    assert not any(compiled.values()), f"compiled as frames of their own: {compiled}"


def test_compiled_memory_model_matches_runtime(tmp_path):
    """``tetrad memory --compile``: the blocks under ``torch.compile`` save what
    :func:`tetrad.plan.memory.activations.compiled_block_delta` says, to the byte (fp32 in
    each mode, bf16 autocast without checkpointing, one rank), and no cheap function is
    compiled as a frame of its own (:func:`_assert_no_frame_per_cheap_function`)."""
    run_distributed(_compiled_worker, 1, str(tmp_path))
    sizes = (1, 1, 1, 1)
    for mode in COMPILED_MODES:
        got = json.loads((tmp_path / f"compiled_{mode}.json").read_text())
        want = {}
        for key, dtype in (("activations", "fp32"), ("activations_bf16", "bf16")):
            s = saved_activations(  # plain torch.autocast: an fp32 residual stream
                CFG,
                sizes,
                MICRO,
                SEQ,
                activation_checkpointing=mode,
                dtype=dtype,
                compiled=True,
                residual="fp32",
            )
            want[key] = s["blocks"] + s["embedding"] + s["final_norm"] + s["loss"]
            if dtype == "fp32":
                want["recompute"] = s["recompute"]
        # bf16 on CPU: SDPA's heads-major output costs each block one more [m, a d] copy (see
        # predicted())
        want["activations_bf16"] += CFG.n_layers * 2 * MICRO * SEQ * CFG.q_dim
        line = ", ".join(f"{k} {got[k]}/{want[k]:.0f}" for k in got)
        print(f"compiled {mode} measured/predicted bytes: {line}")
        for k in got:
            assert got[k] == want[k], f"compiled {mode} {k}: {line}"
        if mode == "full":  # the rebuilt block saves the compiled set, not the eager one
            eager_set = saved_activations(
                CFG, sizes, MICRO, SEQ, activation_checkpointing=mode, dtype="fp32"
            )
            delta = compiled_block_delta(CFG, sizes, MICRO, SEQ, "fp32")[0]
            assert got["recompute"] == want["recompute"] == eager_set["recompute"] + delta, line
        eager = saved_activations(CFG, sizes, MICRO, SEQ, dtype="fp32")
        compiled = saved_activations(CFG, sizes, MICRO, SEQ, dtype="fp32", compiled=True)
        assert compiled["blocks"] < eager["blocks"]  # the delta is real: compiling saves less
