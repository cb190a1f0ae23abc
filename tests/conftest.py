"""Shared by the tests: one thread per process (ranks are processes), and the small text
corpus of the training tests that need no particular text (a test module may define its own
``corpus``)."""

import os

import pytest
import torch

torch.set_num_threads(1)

# Inductor's CPU kernels without SIMD, in every test process, rank and subprocess (inherited):
# the compiled tests check what Dynamo traces, AOTAutograd differentiates and Inductor fuses and
# frees; the vector instructions change only the C++ it writes, whose headers made each kernel's
# compile slower (a cold cache's test_compiled_blocks_match_reference: 63 s of CPU with them,
# 52 s without).
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """One text file of 900 lines of Python keywords (about 50 KB)."""
    root = tmp_path_factory.mktemp("corpus")
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "None"]
    lines = [" ".join(words[(i * 7 + j * 3) % 10] for j in range(9)) + "\n" for i in range(900)]
    (root / "input.txt").write_text("".join(lines))
    return root / "input.txt"
