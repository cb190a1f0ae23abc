"""The vocabulary-parallel LM head: it matches ``torch.nn``, and its collectives (with the
embedding's and the loss's) are a hand count that does not grow with the vocabulary.

On the grid (1, 1, 2, 2) (X and Y > 1, Z = 1: no weight all-gathers), one forward and backward
of embedding -> LM head -> cross-entropy over ``m`` tokens per rank, ``h`` hidden, fp32 (4 B):

    Y: embedding all-reduce m h/G_x, head dx all-reduce m h/G_x, 3 loss all-reduces m
    X: head input all-gather m h (output), head dx reduce-scatter m h (input), 3 loss
       all-reduces m

The same counts for V = 256 and V = 4096: only the local logits grow with V, never a collective.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.distributed import run_distributed
from tetrad.grid import Grid
from tetrad.parallel import Embedding, VocabParallelHead, vocab_parallel_cross_entropy

B, S, H = 4, 8, 16  # whole batch on every rank (G_data = G_z = 1): m = B S tokens


def _step(grid: Grid, vocab: int, ids: torch.Tensor, check: bool) -> dict:
    torch.manual_seed(0)
    emb_ref, head_ref = nn.Embedding(vocab, H), nn.Linear(H, vocab, bias=False)
    emb, head = Embedding(vocab, H, grid), VocabParallelHead(H, vocab, grid)
    with torch.no_grad():
        emb.weight.copy_(emb_ref.weight[emb.weight.placement.local_slices(grid)])
        head.weight.copy_(head_ref.weight[head.weight.placement.local_slices(grid)])
    grid.comm.reset()
    losses = vocab_parallel_cross_entropy(head(emb(ids[:, :-1])), ids[:, 1:], grid)
    losses.sum().backward()
    counts = {a: (st.calls, st.payload_bytes) for a, st in grid.comm.reset().items()}
    if check:
        ref = F.cross_entropy(
            head_ref(emb_ref(ids[:, :-1])).flatten(0, 1), ids[:, 1:].flatten(), reduction="none"
        )
        ref.sum().backward()
        torch.testing.assert_close(losses.flatten(), ref, rtol=1e-5, atol=1e-5)
        for layer, r in ((emb, emb_ref), (head, head_ref)):
            expected = r.weight.grad[layer.weight.placement.local_slices(grid)]
            torch.testing.assert_close(layer.weight.grad, expected, rtol=1e-5, atol=1e-5)
    return counts


def _worker(out: str) -> None:
    grid = Grid.build((1, 1, 2, 2))
    got = {}
    for vocab in (256, 4096):
        ids = torch.randint(0, vocab, (B, S + 1), generator=torch.Generator().manual_seed(1))
        got[vocab] = _step(grid, vocab, ids, check=True)
    if dist.get_rank() == 0:
        Path(out, "counts.json").write_text(json.dumps(got))


def test_head_matches_torch_and_moves_no_logits(tmp_path):
    run_distributed(_worker, 4, str(tmp_path))
    got = json.loads((tmp_path / "counts.json").read_text())
    m, f = B * S, 4
    gx = 2
    expected = {
        "y": [5, f * (m * H // gx + m * H // gx + 3 * m)],
        "x": [5, f * (m * H + m * H + 3 * m)],
    }
    for vocab, counts in got.items():
        assert counts == expected, f"V={vocab}: {counts} != {expected}"
