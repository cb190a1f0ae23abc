"""The sharded optimizer (ZeRO-1, :mod:`tetrad.parallel.zero`) against the single-process
reference: losses, gradient norms, the first step's clipped gradients (each rank's pieces) and
the updated weights of several AdamW steps, at the tolerances of ``tests/test_model.py``, on
data, data x Z, data x context, data x Y, data x X and pipeline x data grids, with overlaps on
and off."""

import dataclasses

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_model import BATCH, CLIP, LR, MICRO, OVERLAP_OPTIONS, SEED, SEQ, STEPS
from tetrad.grid import Grid
from tetrad.models.reference import Llama as Reference
from tetrad.parallel import init_parameters
from tetrad.parallel.model import ParallelLlama
from tetrad.parallel.zero import DataShards, ShardedAdamW, settle_parameters
from tetrad.pipeline.schedule import Pipeline
from tetrad.pipeline.step import pipeline_train_step
from tetrad.plan.memory.sharded_optimizer import unit_elements
from tetrad.spec.overlap import OVERLAPS
from tetrad.spec.presets import PRESETS
from tetrad.train.step import build_optimizer, lr_at, train_step

CFG = dataclasses.replace(PRESETS["tiny"], n_layers=4)
ALL, NONE = tuple(OVERLAPS), ()


def batches():
    g = torch.Generator().manual_seed(SEED)
    return [torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def reference_run():
    """Plain PyTorch on the whole batch: (losses, norms), the first step's clipped gradients,
    the final weights."""
    model = Reference(CFG)
    init_parameters(model, SEED)
    opt = build_optimizer(model, LR, weight_decay=0.1)
    losses, norms, first = [], [], {}
    for step, batch in enumerate(batches()):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, LR, LR / 10, 2, STEPS)
        loss = model.loss_sum(batch[:, :-1], batch[:, 1:]) / batch[:, 1:].numel()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        if step == 0:
            first = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    return (losses, norms), first, weights


@pytest.fixture(scope="module")
def reference():
    return reference_run()


def _snapshot_pieces(opt: ShardedAdamW, into: dict) -> None:
    """Keep the first step's reduced, clipped pieces (the all-gather forgets them)."""
    gather = opt.shards.all_gather

    def run(*args, **kwargs):
        if not into:
            into.update({id(p): opt.shards.grads[id(p)].clone() for p, _ in opt.pairs})
        gather(*args, **kwargs)

    opt.shards.all_gather = run


def build_model(pipe, sizes, overlaps, cfg=CFG):
    """``(grid, model, the modules holding its weights)``: a ParallelLlama of ``cfg`` on
    ``sizes``, or with ``pipe > 1`` a 1F1B Pipeline of it, initialised from :data:`SEED`."""
    grid = Grid.build(sizes, pipe=pipe)
    if pipe == 1:
        model = ParallelLlama(cfg, grid, "none", overlaps, **OVERLAP_OPTIONS)
        init_parameters(model, SEED, grid)
        return grid, model, model
    m = BATCH // (grid.data * grid.z) // MICRO
    model = Pipeline(cfg, grid, "1f1b", 1, m, overlaps=overlaps, **OVERLAP_OPTIONS)
    for part in model.parts:
        init_parameters(part, SEED, grid)
    return grid, model, model.parts


def zero_runs(world_size, ref_curves, ref_first, ref_weights, cases):
    for pipe, sizes, overlaps in cases:
        grid, model, weights = build_model(pipe, sizes, overlaps)
        opt = build_optimizer(weights, LR, weight_decay=0.1, shard=grid)
        assert isinstance(opt, ShardedAdamW) and opt.shards.size == grid.size("data")
        pieces: dict = {}
        _snapshot_pieces(opt, pieces)
        label = f"pipe {pipe} grid {sizes} overlaps {sorted(overlaps)}"
        for step, batch in enumerate(batches()):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, LR, LR / 10, 2, STEPS)
            if pipe > 1:
                loss, norm = map(float, pipeline_train_step(model, opt, batch, CLIP))
            else:
                loss, norm = map(float, train_step(model, opt, grid, batch, MICRO, CLIP))
            assert opt.shards.pending, f"{label} step {step}: the all-gathers did not overlap"
            ref_loss, ref_norm = ref_curves[0][step], ref_curves[1][step]
            assert abs(loss - ref_loss) <= 1e-5 * ref_loss, f"{label} step {step}: {loss}"
            assert abs(norm - ref_norm) <= 1e-4 * ref_norm, f"{label} step {step}: norm {norm}"
        settle_parameters(opt)
        worst_grad = worst = 0.0
        for name, p in weights.named_parameters():
            expected = opt.shards.piece(p.placement.shard_of(ref_first[name], grid).contiguous())
            worst_grad = max(worst_grad, (pieces[id(p)] - expected).abs().max().item())
            local = p.placement.shard_of(ref_weights[name], grid)
            worst = max(worst, (p.detach() - local).abs().max().item())
            state = opt.state_of(p)
            assert state["exp_avg"].numel() == opt.shards.piece(p.data).numel(), label
        assert worst_grad <= 1e-5, f"{label}: gradients differ by {worst_grad:.3g}"
        assert worst <= 0.05 * LR, f"{label}: weights differ by {worst / LR:.3g} lr"
        if not any(grid.coord.values()):
            print(f"{label}: worst gradient {worst_grad:.2e}, weight {worst / LR:.2e} lr")


CASES = {
    2: [(1, (2, 1, 1, 1), ALL), (1, (2, 1, 1, 1), NONE)],
    4: [
        (1, (4, 1, 1, 1), ALL),
        (1, (4, 1, 1, 1), NONE),
        (1, (2, 2, 1, 1), ALL),
        (1, (2, 2, 1, 1), NONE),
        (1, (2, 2, 1, 1, 1), ALL),
        (1, (2, 1, 1, 2), ALL),
        (1, (2, 1, 2, 1), NONE),
        (2, (2, 1, 1, 1, 1), ALL),
        (2, (2, 1, 1, 1, 1), NONE),
    ],
}


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_sharded_optimizer_matches_reference(world_size, reference):
    run_distributed(zero_runs, world_size, world_size, *reference, CASES[world_size])


def _padding_worker(world_size):
    """Pieces of tensors that ``G`` does not divide (7, 1, 5 elements on 3 ranks: pieces of
    3, 1 and 2 elements, some empty): the reduce-scatter leaves each rank the sum of its piece,
    the all-gather rebuilds every tensor from the pieces."""
    grid = Grid.build((world_size, 1, 1, 1))
    shards = DataShards(grid)
    rank = shards.rank
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (7, 1, 5)]
    params.append(torch.nn.Parameter(torch.zeros(2, 3)))
    grads = [torch.arange(p.numel(), dtype=torch.float32).view_as(p) * (rank + 1) for p in params]
    shards.take(params, shards.reduce_scatter(params, grads))
    total = sum(range(1, world_size + 1))
    for p, g in zip(params, grads, strict=True):
        want = shards.piece(g.detach() / (rank + 1) * total)
        torch.testing.assert_close(shards.grads[id(p)], want)
        shards.piece(p.data).copy_(shards.grads[id(p)])  # the "update": the summed gradient
    shards.all_gather()
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(p.data, g / (rank + 1) * total)
    # AdamW on the pieces (some empty) equals AdamW on the whole tensors
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = ShardedAdamW([{"params": params}], shards, lr=0.1, fused=True)
    plain = torch.optim.AdamW([{"params": ref}], lr=0.1, fused=True)
    for _ in range(2):
        shards.take(params, shards.reduce_scatter(params, grads))
        opt.step()
        for r, g in zip(ref, grads, strict=True):
            r.grad = g / (rank + 1) * total
        plain.step()
        assert shards.pending  # left for the next forward's first reads
    shards.wait_all()
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.data, r.data)


def test_pieces_of_uneven_tensors():
    run_distributed(_padding_worker, 3, 3)


def test_planner_offers_the_sharded_optimizer():
    """``shard_optimizer``: ``off`` never, ``on`` wherever ``G_data G_context > 1``, ``auto``
    only where the unsharded configuration does not fit; the sharded rows' states are divided by
    the data group, and ``--emit-config`` writes ``shard_optimizer``."""
    from tetrad.plan.machine.description import get_machine
    from tetrad.plan.search.plan import plan
    from tetrad.plan.search.report import train_config_text
    from tetrad.spec.presets import get_model

    model, machine = get_model("llama-3.1-8b"), get_machine("dgx-h100")
    args = (model, machine, 16, 32, 4096)
    opts = {"top": 5, "classic": False, "pipeline": False}
    off = plan(*args, shard_optimizer="off", **opts)
    on = plan(*args, shard_optimizer="on", **opts)
    auto = plan(*args, shard_optimizer="auto", **opts)
    assert not any(r.shard_optimizer for r in off.rows)
    assert all(r.shard_optimizer == (r.sizes["data"] * r.sizes["context"] > 1) for r in on.rows)
    assert auto.rows[0].step_s <= off.rows[0].step_s
    sharded = [r for r in on.rows if r.shard_optimizer]
    assert sharded and "shard_optimizer = true" in train_config_text(sharded[0], model, on)
    for r in sharded:
        plain = next((o for o in off.rows if o.label() == r.label().replace(" so", "")), None)
        if plain is not None and plain.micro_batch == r.micro_batch:
            g = r.sizes["data"] * r.sizes["context"]
            want = plain.memory.components["optimizer_states"] / g
            assert abs(r.memory.components["optimizer_states"] - want) <= 1e-6 * want


def _overlap_worker(world_size):
    """The parameter all-gathers after the update are left pending and waited in the next
    step's forward, one unit (embedding, block, final norm with head) at a time: after the update
    only the embedding's is in flight and the head's is queued last; at a module's forward
    pre-hook (after the optimizer's own, registered first) none of its parameters is pending
    while the later modules' still are, and at most one unit is ever in flight."""
    grid, model, _ = build_model(1, (world_size, 1, 1, 1), ALL)
    opt = build_optimizer(model, LR, weight_decay=0.1, shard=grid)
    opt.shards.least = 0  # one all-gather per unit (the tiny model's would go in one group)
    seen: list[tuple[bool, int]] = []
    for batch in batches()[:2]:
        train_step(model, opt, grid, batch, MICRO, CLIP)
        if not seen:  # after the first step: the optimizer's hooks exist, ours run after them
            pending = dict(opt.shards.pending)
            assert pending, "nothing left pending after the update"
            units = list({id(e[0]): e for e in pending.values()}.values())
            assert len(units) == 2 + len(model.layers)  # embedding, blocks, norm with head
            flying = [e for e in units if e[1] is not None]
            emb = model.tok_embeddings.weight
            assert len(flying) == 1 and flying[0][0] == [emb], "not the embedding's alone"
            head = model.output.weight
            tail = [model.norm.weight, head]
            assert units[-1][0] == tail, "the head's all-gather is not queued last"
            # the planner's units (tetrad memory's step buffers) are the runtime's
            want = unit_elements(CFG, (world_size, 1, 1, 1))
            sizes = [sum(p.numel() for p in e[0]) for e in units]
            tail = want["final_norm"] + want["head"]
            assert sizes == [want["embedding"]] + [want["block"]] * CFG.n_layers + [tail]
            assert flying[0][1].result.numel() == want["embedding"]
            for m in model.modules():
                own = list(m.parameters(recurse=False))
                if own:
                    m.register_forward_pre_hook(
                        lambda _m, _a, own=own: seen.append(
                            (
                                any(id(p) in opt.shards.pending for p in own)
                                or len({id(e[1]) for e in opt.shards.pending.values()} - {id(None)})
                                > 1,
                                len(opt.shards.pending),
                            )
                        )
                    )
    assert seen and not any(mine for mine, _ in seen), "a module ran before its all-gather"
    assert seen[0][1] > 0, "the first module found every all-gather already waited"
    counts = [n for _, n in seen]
    assert counts == sorted(counts, reverse=True)


def test_parameter_gathers_overlap_the_next_forward():
    run_distributed(_overlap_worker, 2, 2)


def test_gather_groups_close_at_the_least_bytes():
    """:func:`tetrad.spec.overlap.gather_groups`: consecutive units together until their bytes
    reach the least, the last run below it if that is what is left; units at or above it alone."""
    from tetrad.spec.overlap import gather_groups

    assert gather_groups([5, 5, 5, 5, 5], 10) == [range(0, 2), range(2, 4), range(4, 5)]
    assert gather_groups([30, 1, 1, 30], 10) == [range(0, 1), range(1, 4)]
    assert gather_groups([3, 3], 10) == [range(0, 2)]
    assert gather_groups([], 10) == []
    assert gather_groups([1, 2, 3], 0) == [range(0, 1), range(1, 2), range(2, 3)]


def test_gather_exposure_is_the_forwards_lateness():
    """:func:`tetrad.plan.comm.layers.chain_exposed` against a replay of the runtime's chain
    (tetrad/parallel/zero.py): unit ``i + 1``'s all-gather issued when unit ``i`` is waited,
    its first read ``slack[i]`` later; the exposure is how long each read waits."""
    from tetrad.plan.comm.layers import chain_exposed

    def replay(times, slack):
        waited, out = times[0], [times[0]]  # the first, issued by the update, read at once
        for i in range(1, len(times)):
            read, done = waited + slack[i - 1], waited + times[i]
            out.append(max(0.0, done - read))
            waited = max(read, done)
        return out

    for times, slack in [
        ([3, 1, 1, 1, 5], [0, 2, 2, 2, 0]),
        ([1, 4, 4, 4, 2], [0, 1, 9, 1, 0]),
        ([2, 2], [0, 0]),
    ]:
        assert chain_exposed(times, slack) == replay(times, slack)
        assert sum(chain_exposed(times, [0] * len(times))) == sum(times)
