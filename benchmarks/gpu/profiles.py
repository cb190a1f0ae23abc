"""The sizes and limits of ``benchmarks/gpu_check.py`` per device: on CUDA the real check
(llama-1b, seq 2048), on CPU a smoke test with tiny sizes that runs every code path."""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LayerSizes:
    """Shapes of the layer checks: ``batch x seq`` tokens, ``hidden -> ffn`` Linear, ``vocab``."""

    batch: int
    seq: int
    hidden: int
    ffn: int
    vocab: int


@dataclass(frozen=True)
class Profile:
    """The sizes and limits of one device (seconds for the time limits)."""

    model: str
    seq_len: int
    steps: int
    log_every: int
    warmup: int
    micro_batches: tuple[int, ...]
    check_model: str
    check_batch: int
    check_seq: int
    layers: LayerSizes
    data: tuple[str, ...]
    bpe_vocab: int | None
    budget_s: float
    run_timeout_s: float
    profile_steps: tuple[int, int]


PROFILES = {
    "cuda": Profile(
        model="llama-1b,vocab_size=32768",
        seq_len=2048,
        steps=20,
        log_every=5,
        warmup=5,
        micro_batches=(1, 2, 4, 8, 16),
        check_model="medium",
        check_batch=4,
        check_seq=512,
        layers=LayerSizes(batch=4, seq=256, hidden=1024, ffn=2816, vocab=8192),
        data=(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py"),),  # ~7 MB
        bpe_vocab=None,
        budget_s=280.0,  # benchmarks/gpu_all.sh stops the check at 300 s
        run_timeout_s=170.0,
        profile_steps=(17, 18),
    ),
    "cpu": Profile(
        model="tiny,vocab_size=512",
        seq_len=64,
        steps=20,
        log_every=5,
        warmup=2,
        # up to 2, the model check's micro-batch (4 sequences in 2): the compiled CPU run
        # took 42 s of CPU with micro-batch 2, 73 s with 4. It still compiles
        # graphs of its own (14 in Inductor's cache against the check's 9), not the check's.
        micro_batches=(1, 2),
        check_model="tiny",
        check_batch=4,
        check_seq=64,
        layers=LayerSizes(batch=4, seq=16, hidden=64, ffn=128, vocab=256),
        data=(str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py"),),  # ~50 KB
        bpe_vocab=512,
        budget_s=480.0,  # a loaded 2-core machine: the compile run alone took 100 s
        run_timeout_s=300.0,
        profile_steps=(17, 18),
    ),
}
"""CUDA: the real check. CPU: tiny sizes, a small corpus, every code path in about a minute."""
