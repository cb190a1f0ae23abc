"""The vocabulary-parallel LM head: it matches ``torch.nn``, and its collectives (with the
embedding's and the loss's) are a hand count that does not grow with the vocabulary.

On the grid (1, 1, 2, 2) (X and Y > 1, Z = 1: no weight all-gathers), one forward and backward
of embedding -> LM head -> cross-entropy over ``m`` tokens per rank, ``h`` hidden, fp32 (4 B),
both as training runs it (the head and the loss fused, :func:`tetrad.parallel.lm_head_loss`,
in row blocks of 5 tokens here) and as logits then :func:`vocab_parallel_cross_entropy`:

    Y: embedding all-reduce m h/G_x, head dx all-reduce m h/G_x, 3 loss all-reduces m
    X: head input all-gather m h (output), head dx reduce-scatter m h (input), 3 loss
       all-reduces m

The fused loss makes its 3 loss all-reduces per row block (7 blocks of at most 5 of the 32
tokens: 21 calls of the same ``m`` rows in all), so it keeps no more than one block's logits.
The same counts for V = 256 and V = 4096 and a padded vocabulary: only the local logits grow
with V, never a collective.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.distributed import run_distributed
from tetrad.grid import Grid
from tetrad.parallel import (
    Embedding,
    VocabParallelHead,
    lm_head_loss,
    vocab_parallel_cross_entropy,
)
from tetrad.spec import overlap as spec_overlap

B, S, H = 4, 8, 16  # whole batch on every rank (G_data = G_z = 1): m = B S tokens
CASES = [(256, None, False), (256, None, True), (4096, None, True), (256, 250, True)]
"""(vocabulary, real vocabulary of a padded one, fused)"""


def _layers(grid: Grid, vocab: int):
    torch.manual_seed(0)
    emb_ref, head_ref = nn.Embedding(vocab, H), nn.Linear(H, vocab, bias=False)
    emb, head = Embedding(vocab, H, grid), VocabParallelHead(H, vocab, grid)
    with torch.no_grad():
        emb.weight.copy_(emb.weight.placement.shard_of(emb_ref.weight, grid))
        head.weight.copy_(head.weight.placement.shard_of(head_ref.weight, grid))
    return emb, head, emb_ref, head_ref


def _loss(grid, emb, head, ids, real, fused):
    x, targets = emb(ids[:, :-1]), ids[:, 1:]
    if fused:
        return lm_head_loss(head, x, targets, real)
    return vocab_parallel_cross_entropy(head(x), targets, grid, vocab=real).sum()


def _step(grid: Grid, vocab: int, real: int | None, fused: bool, ids: torch.Tensor) -> dict:
    emb, head, emb_ref, head_ref = _layers(grid, vocab)
    grid.comm.reset()
    loss = _loss(grid, emb, head, ids, real, fused)
    loss.backward()
    counts = {a: (st.calls, st.payload_bytes) for a, st in grid.comm.reset().items()}
    logits = head_ref(emb_ref(ids[:, :-1]))[..., :real]
    ref = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    for layer, r in ((emb, emb_ref), (head, head_ref)):
        expected = layer.weight.placement.shard_of(r.weight.grad, grid)
        torch.testing.assert_close(layer.weight.grad, expected, rtol=1e-5, atol=1e-5)
    return counts


def _worker(out: str) -> None:
    grid = Grid.build((1, 1, 2, 2))
    got = {}
    for vocab, real, fused in CASES:
        v_local = vocab // (grid.y * grid.x)
        spec_overlap.LOSS_CHUNK_BYTES["cpu"] = 4 * v_local * 5  # row blocks of 5 of the 32 tokens
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, real or vocab, (B, S + 1), generator=gen)
        got[f"{vocab} {real} {fused}"] = _step(grid, vocab, real, fused, ids)
    if dist.get_rank() == 0:
        Path(out, "counts.json").write_text(json.dumps(got))


def test_head_matches_torch_and_moves_no_logits(tmp_path):
    run_distributed(_worker, 4, str(tmp_path))
    got = json.loads((tmp_path / "counts.json").read_text())
    assert len(got) == len(CASES)
    m, f = B * S, 4
    gx = 2
    for case, counts in got.items():
        calls = 2 + 3 * (-(-m // 5) if case.endswith("True") else 1)  # fused: per row block
        expected = {
            "y": [calls, f * (m * H // gx + m * H // gx + 3 * m)],
            "x": [calls, f * (m * H + m * H + 3 * m)],
        }
        assert counts == expected, f"{case}: {counts} != {expected}"


def _bf16_worker() -> None:
    """Under CPU bf16 autocast the fused path equals logits then cross-entropy to bf16
    precision (logits, softmax blocks and gradient GEMMs in bf16, statistics in fp32)."""
    grid = Grid.build((1, 1, 2, 2))
    ids = torch.randint(0, 256, (B, S + 1), generator=torch.Generator().manual_seed(2))
    got = []
    for fused in (False, True):
        emb, head, _, _ = _layers(grid, 256)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(grid, emb, head, ids, None, fused)
        loss.backward()
        got.append((loss.detach(), emb.weight.grad, head.weight.grad))
    for a, b in zip(*got, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_fused_head_and_loss_in_bf16():
    run_distributed(_bf16_worker, 4)


def _added_worker() -> None:
    """Three micro-batches whose loss sums are divided by the tokens of all three: with the
    scale given (``grad_scale``), each puts its ``dW`` into the head's gradient in forward
    (:func:`tetrad.parallel.loss.add_product`, once per row block; the first micro-batch's
    first block writes, every other adds), in the 4D order (forward, backward, forward, ...)
    and in GPipe's (every forward first), and the gradients equal the run without it; in bf16
    too (the fp32 gradient, the product formed in bf16 on CPU). A backward that brings another
    gradient raises."""
    from tetrad.parallel import loss as loss_module

    calls = []
    plain = loss_module.add_product

    def counted(out, a, b, alpha, beta=1.0):
        calls.append(beta)
        plain(out, a, b, alpha, beta)

    loss_module.add_product = counted
    for shape in ((1, 1, 2, 2), (4, 1, 1, 1)):  # the vocabulary split (all-reduces) or not
        grid = Grid.build(shape)
        v_local = 256 // (grid.y * grid.x)
        spec_overlap.LOSS_CHUNK_BYTES["cpu"] = 4 * v_local * 5  # row blocks of 5 of 32
        ids = torch.randint(0, 256, (3, B, S + 1), generator=torch.Generator().manual_seed(3))
        n = ids[:, :, 1:].numel()
        for dtype, gpipe in (
            (torch.float32, False),
            (torch.bfloat16, False),
            (torch.float32, True),
        ):
            got = []
            for scale in (None, 1 / n):
                calls.clear()
                emb, head, _, _ = _layers(grid, 256)
                losses = []
                for mb in ids:
                    bf16 = dtype != torch.float32
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                        x, targets = emb(mb[:, :-1]), mb[:, 1:]
                        losses.append(lm_head_loss(head, x, targets, grad_scale=scale) / n)
                    if not gpipe:
                        losses.pop().backward()
                for loss in losses:
                    loss.backward()
                # 7 row blocks of 32 rows per micro-batch; the first block of the first writes
                assert calls == ([] if scale is None else [0.0] + [1.0] * 20), calls
                got.append((emb.weight.grad, head.weight.grad))
            # bf16: the old path rounds each micro-batch's dW sum to bf16, the new one does not
            bf16 = {"rtol": 2e-2, "atol": 1e-3}
            tol = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else bf16
            for a, b in zip(*got, strict=True):
                torch.testing.assert_close(a, b, **tol)
        x, targets = emb(ids[0, :, :-1]), ids[0, :, 1:]
        loss = lm_head_loss(head, x, targets, grad_scale=1 / n) / n
        try:
            (2 * loss).backward()
        except RuntimeError as e:
            assert "differs from grad_scale" in str(e)
        else:
            raise AssertionError("a backward against the promised scale went through")
    loss_module.add_product = plain


def test_micro_batches_put_the_head_gradient_in_forward():
    run_distributed(_added_worker, 4)
