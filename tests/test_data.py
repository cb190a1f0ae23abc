"""Tests of tetrad.data on small generated text corpora (the stdlib run is measured by hand; the
other formats, preparation and resume: tests/test_data_formats.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tetrad.data.corpus import Corpus, prepare_corpus
from tetrad.data.errors import DataError
from tetrad.data.loader import sample_batch, val_batches
from tetrad.data.sources import corpus_files

VOCAB = 300


def _write_corpus(root, n_files: int = 12) -> list:
    """A few KB of Python-like text in ``n_files`` files (two subfolders) plus one binary file."""
    paths = []
    for i in range(n_files):
        sub = root / f"pkg{i % 2}"
        sub.mkdir(parents=True, exist_ok=True)
        lines = [f'"""Module {i}: helpers for widget number {i}."""', "", "import os", ""]
        for j in range(15):
            lines += [
                f"def func_{i}_{j}(value, scale={j}):",
                f'    """Return value times {j} plus the length of {i!r}."""',
                f"    total = value * scale + len(os.sep) + {i * j}",
                "    return total  # café ✓",
                "",
            ]
        p = sub / f"mod{i}.py"
        p.write_text("\n".join(lines), encoding="utf-8")
        paths.append(p)
    (root / "pkg0" / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    return paths


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    _write_corpus(root)
    return root


@pytest.fixture(scope="module")
def corpus(corpus_dir, tmp_path_factory) -> Corpus:
    cache = tmp_path_factory.mktemp("cache")
    return prepare_corpus([str(corpus_dir)], vocab_size=VOCAB, val_fraction=0.2, cache_dir=cache)


def test_missing_path_is_a_data_error(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(DataError, match=r"data path '.*nope' does not exist: pass existing"):
        corpus_files([missing])
    with pytest.raises(DataError, match="does not exist"):
        corpus_files([str(tmp_path / "*.nothing")])
    with pytest.raises(DataError, match="does not exist"):
        prepare_corpus([missing], vocab_size=VOCAB, cache_dir=tmp_path)


def test_folder_glob_and_file_inputs(corpus_dir):
    all_py = sorted(p.resolve() for p in corpus_dir.rglob("*.py"))
    assert corpus_files([str(corpus_dir)]) == all_py  # binary blob.bin skipped
    assert corpus_files([str(corpus_dir / "**" / "*.py")]) == all_py
    pkg1 = corpus_files([str(corpus_dir / "pkg1" / "*.py")])
    assert pkg1 == [p for p in all_py if p.parent.name == "pkg1"]
    one = all_py[0]
    assert corpus_files([str(one), str(one), str(corpus_dir / "pkg1")]) == sorted({one, *pkg1})


def test_default_is_the_stdlib():
    files = corpus_files([])
    names = {f.name for f in files}
    assert "os.py" in names and "dataclasses.py" in names
    assert all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts or "dist-packages" in f.parts for f in files)


def test_split_by_file(corpus_dir, corpus):
    assert len(corpus.train) > 0 and len(corpus.val) > 0
    assert corpus.train.ndim == corpus.val.ndim == 1
    assert corpus.train.dtype == np.uint16 and corpus.vocab_size <= VOCAB
    assert corpus.n_files == 12
    assert corpus.n_bytes == sum(p.stat().st_size for p in corpus_dir.rglob("*.py"))
    # Each file ends with <|endoftext|> (id 0): the documents of the two streams are disjoint.
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(corpus.tokenizer_path))
    assert tok.token_to_id("<|endoftext|>") == 0

    def docs(stream):
        ends = np.flatnonzero(np.asarray(stream) == 0)
        return [tok.decode(d.tolist()) for d in np.split(np.asarray(stream), ends + 1)[:-1]]

    train_docs, val_docs = docs(corpus.train), docs(corpus.val)
    assert len(train_docs) + len(val_docs) == 12 and train_docs and val_docs
    texts = {p.read_text(encoding="utf-8") for p in corpus_dir.rglob("*.py")}
    assert set(train_docs) | set(val_docs) == texts
    assert not set(train_docs) & set(val_docs)


def test_split_keeps_one_file_each_side(corpus_dir, tmp_path):
    for frac in (1e-6, 0.999999):
        c = prepare_corpus(
            [str(corpus_dir)], vocab_size=VOCAB, val_fraction=frac, cache_dir=tmp_path
        )
        assert len(c.train) > 0 and len(c.val) > 0
    with pytest.raises(DataError, match="val_fraction"):
        prepare_corpus([str(corpus_dir)], val_fraction=0.0, cache_dir=tmp_path)


def test_one_file_is_split_by_tokens(corpus_dir, tmp_path):
    """One text file (an ``input.txt``): its last ``val_fraction`` of tokens are held out."""
    one = corpus_dir / "pkg0" / "mod0.py"
    c = prepare_corpus([str(one)], vocab_size=VOCAB, val_fraction=0.1, cache_dir=tmp_path)
    stream = np.concatenate([np.asarray(c.train), np.asarray(c.val)])
    assert len(c.val) == round(len(stream) * 0.1) and len(c.train) > len(c.val)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(c.tokenizer_path))
    assert tok.decode(stream[:-1].tolist()) == one.read_text(encoding="utf-8")
    assert stream[-1] == tok.token_to_id("<|endoftext|>")


def test_each_unusable_input_has_its_own_message(corpus_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"data path '.*empty' holds no files: put text files"):
        corpus_files([str(tmp_path / "empty")])
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "a.bin").write_bytes(b"\x00\x01")
    (tmp_path / "bin" / "b.bin").write_bytes(b"\x02\x00")
    with pytest.raises(DataError, match=r"holds 2 file\(s\), none of them text"):
        corpus_files([str(tmp_path / "bin")])
    with pytest.raises(DataError, match=r"data file '.*blob.bin' is binary"):
        corpus_files([str(corpus_dir / "pkg0" / "blob.bin")])


def test_tokenizer_round_trip(corpus_dir, corpus):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(corpus.tokenizer_path))
    train = np.asarray(corpus.train)
    first_doc = train[: int(np.flatnonzero(train == 0)[0])]
    text = tok.decode(first_doc.tolist())
    assert text in {p.read_text(encoding="utf-8") for p in corpus_dir.rglob("*.py")}
    assert tok.encode(text).ids == first_doc.tolist()


def test_cache_hit(corpus_dir, tmp_path):
    c1 = prepare_corpus([str(corpus_dir)], vocab_size=VOCAB, val_fraction=0.2, cache_dir=tmp_path)
    t0 = time.perf_counter()
    c2 = prepare_corpus([str(corpus_dir)], vocab_size=VOCAB, val_fraction=0.2, cache_dir=tmp_path)
    assert time.perf_counter() - t0 < 1.0
    assert all(isinstance(s, np.memmap) for s in c2.train.shards)
    np.testing.assert_array_equal(c1.train, c2.train)
    np.testing.assert_array_equal(c1.val, c2.val)
    assert c1.tokenizer_path == c2.tokenizer_path and c1.unigram_entropy == c2.unigram_entropy
    entries = [p for p in tmp_path.iterdir()]
    assert len(entries) == 1 and not entries[0].name.startswith(".")
    assert {p.name for p in entries[0].iterdir()} == {
        ".lock",
        "tokenizer.json",
        "job.json",
        "index.json",
        "shards",
    }
    # Different inputs -> a different entry; the loaded tokenizer is reused as is.
    c3 = prepare_corpus(
        [str(corpus_dir)], tokenizer=str(c1.tokenizer_path), val_fraction=0.2, cache_dir=tmp_path
    )
    assert len(list(tmp_path.iterdir())) == 2
    np.testing.assert_array_equal(c1.train, c3.train)
    with pytest.raises(DataError, match="tokenizer"):
        prepare_corpus([str(corpus_dir)], tokenizer=str(tmp_path / "no.json"), cache_dir=tmp_path)


def test_unigram_entropy(corpus):
    counts = np.bincount(np.asarray(corpus.train), minlength=corpus.vocab_size)
    p = counts[counts > 0] / counts.sum()
    assert corpus.unigram_entropy == pytest.approx(-(p * np.log(p)).sum(), rel=1e-9)
    assert 0 < corpus.unigram_entropy < np.log(corpus.vocab_size)


def test_sample_batch():
    tokens = np.arange(1000, dtype=np.uint16)
    b = sample_batch(tokens, step=3, batch=4, seq_len=16, seed=7)
    assert b.shape == (4, 17) and b.dtype == torch.int64
    assert torch.equal(b[:, 1:] - b[:, :-1], torch.ones(4, 16, dtype=torch.int64))  # consecutive
    assert torch.equal(b, sample_batch(tokens, step=3, batch=4, seq_len=16, seed=7))
    assert not torch.equal(b, sample_batch(tokens, step=4, batch=4, seq_len=16, seed=7))
    assert not torch.equal(b, sample_batch(tokens, step=3, batch=4, seq_len=16, seed=8))
    # The global torch RNG plays no part.
    torch.manual_seed(0)
    x = sample_batch(tokens, step=3, batch=4, seq_len=16, seed=7)
    torch.manual_seed(1)
    assert torch.equal(x, b)
    # Exactly seq_len + 1 tokens: one possible window.
    assert torch.equal(sample_batch(tokens[:17], 0, 2, 16, 0)[0], torch.arange(17))
    with pytest.raises(DataError, match="corpus has 16 tokens, fewer than seq_len\\+1 = 17"):
        sample_batch(tokens[:16], step=0, batch=1, seq_len=16, seed=0)


def test_val_batches():
    tokens = np.arange(10_000, dtype=np.uint16)
    vb = val_batches(tokens, n_batches=3, batch=2, seq_len=32)
    assert len(vb) == 3 and all(b.shape == (2, 33) and b.dtype == torch.int64 for b in vb)
    assert all(torch.equal(a, b) for a, b in zip(vb, val_batches(tokens, 3, 2, 32), strict=True))
    starts = torch.cat(vb)[:, 0]
    assert starts[0] == 0 and starts[-1] == 10_000 - 33  # spread over the whole stream
    assert bool((starts[1:] - starts[:-1] >= 33).all())  # non-overlapping
    short = val_batches(tokens[:100], n_batches=2, batch=4, seq_len=32)  # too short: overlap
    s = torch.cat(short)[:, 0]
    assert s[0] == 0 and s[-1] == 100 - 33 and bool((s[1:] >= s[:-1]).all())
    assert torch.equal(torch.cat(short)[:, 1:] - torch.cat(short)[:, :-1], torch.ones(8, 32).long())
    with pytest.raises(DataError):
        val_batches(tokens[:10], 1, 1, 32)


def test_crash_leaves_no_loadable_entry(corpus_dir, tmp_path, monkeypatch):
    import tetrad.data.shards as shards

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(shards.np, "savez", boom)
    with pytest.raises(OSError, match="disk full"):
        prepare_corpus([str(corpus_dir)], vocab_size=VOCAB, val_fraction=0.2, cache_dir=tmp_path)
    (entry,) = tmp_path.iterdir()
    assert not (entry / "index.json").exists()  # unfinished: never loaded, resumed next time
    monkeypatch.undo()
    c = prepare_corpus([str(corpus_dir)], vocab_size=VOCAB, val_fraction=0.2, cache_dir=tmp_path)
    assert len(c.train) > 0 and len(c.val) > 0
