"""Shared by the tests: one thread per process (ranks are processes), and the small text
corpus of the training tests that need no particular text (a test module may define its own
``corpus``)."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """One text file of 900 lines of Python keywords (about 50 KB)."""
    root = tmp_path_factory.mktemp("corpus")
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "None"]
    lines = [" ".join(words[(i * 7 + j * 3) % 10] for j in range(9)) + "\n" for i in range(900)]
    (root / "input.txt").write_text("".join(lines))
    return root / "input.txt"
