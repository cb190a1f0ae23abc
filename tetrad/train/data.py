"""Training data: text files -> byte-level BPE token streams (cached) -> fixed-shape batches.

``prepare_corpus`` turns text files (by default the running interpreter's standard library) into
flat train/val token-id arrays, split by file (a single file by tokens) and cached on disk, so
later calls just memory-map them. ``sample_batch``/``val_batches`` cut ``[batch, seq_len + 1]``
windows out of those arrays (inputs ``[:, :-1]``, next-token targets ``[:, 1:]``).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import pathlib
import shutil
import sysconfig
import tempfile

import numpy as np
import torch

from tetrad.spec import TetradError

FORMAT_VERSION = 3  # 2: a single file is split by tokens; 3: end token of Llama tokenizers
EOT = "<|endoftext|>"
# The end-of-document token appended to each file: ours, then those of Llama 3 and Llama 2.
END_TOKENS = (EOT, "<|end_of_text|>", "</s>")
BPE_TRAIN_BYTES = 8_000_000  # the BPE is trained on at most this much train text (see below)
ENCODE_CHUNK_BYTES = 4_000_000  # files are encoded in batches of about this much text


class DataError(TetradError):
    """Data that tetrad cannot use; the one-line message says what to change."""


def _missing(p: str) -> DataError:
    msg = f"data path {p!r} does not exist: pass existing files, folders or globs to --data"
    return DataError(msg)


def _is_text(p: pathlib.Path) -> bool:
    """No NUL byte in the first 8 KiB (how tetrad tells text from binary files)."""
    with open(p, "rb") as f:
        return b"\0" not in f.read(8192)


def _regular_files(folder_or_file: str) -> list[pathlib.Path]:
    """``folder_or_file`` itself, or the regular files below the folder (recursively)."""
    found = [pathlib.Path(folder_or_file)]
    if os.path.isdir(folder_or_file):
        found = [pathlib.Path(d, n) for d, _, names in os.walk(folder_or_file) for n in names]
    return [p for p in found if p.is_file()]


def _entry_files(p: str) -> list[pathlib.Path]:
    """The text files of one ``--data`` entry; DataError naming what is wrong when none."""
    q = os.path.expanduser(p)
    if os.path.isfile(q):
        if not _is_text(pathlib.Path(q)):
            raise DataError(
                f"data file {p!r} is binary (a NUL byte in its first 8 KiB): pass text files"
            )
        return [pathlib.Path(q)]
    matches = [q] if os.path.isdir(q) else glob.glob(q, recursive=True)
    if not matches:
        raise _missing(p)
    found = [f for m in matches for f in _regular_files(m)]
    if not found:
        raise DataError(f"data path {p!r} holds no files: put text files there or pass others")
    text = [f for f in found if _is_text(f)]
    if not text:
        raise DataError(
            f"data path {p!r} holds {len(found)} file(s), none of them text (each has a NUL "
            "byte in its first 8 KiB): pass text files"
        )
    return text


def corpus_files(paths: list[str]) -> list[pathlib.Path]:
    """Expand ``--data`` entries into a sorted, de-duplicated list of absolute text-file paths.

    With ``paths`` empty: every ``*.py`` under the running interpreter's standard library
    (``sysconfig.get_paths()["stdlib"]``), excluding ``site-packages``/``dist-packages``.
    Otherwise each entry is a text file, a folder (all regular files below it, recursively,
    skipping binary files: a NUL byte in the first 8 KiB) or a glob pattern
    (``glob.glob(recursive=True)``; matched folders are expanded, binary files skipped).

    Raises DataError when an entry does not exist or matches nothing, is a binary file, or
    holds no file or no text file (each with its own message).
    """
    if not paths:
        root = sysconfig.get_paths()["stdlib"]
        files = []
        for dirpath, dirnames, names in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages")]
            files += [pathlib.Path(dirpath, n) for n in names if n.endswith(".py")]
        if not files:
            raise _missing(root)
        return sorted({f.resolve() for f in files if f.is_file()})
    return sorted({f.resolve() for p in paths for f in _entry_files(p)})


@dataclasses.dataclass
class Corpus:
    """A tokenized corpus: flat 1-D token-id streams (np.uint16, or np.uint32 when the vocabulary
    exceeds 65535 ids, memory-mapped read-only), each file's ids followed by ``<|endoftext|>``.

    ``unigram_entropy`` is the entropy of the train token frequencies in nats (``-sum p ln p``):
    the loss of a model that only learned token frequencies. ``n_bytes`` counts the raw bytes read.
    """

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    tokenizer_path: pathlib.Path
    unigram_entropy: float
    n_files: int
    n_bytes: int


def _train_bpe(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _encode(tok, files: list[pathlib.Path], eot: int, dtype) -> np.ndarray:
    parts, chunk, size = [], [], 0
    for i, f in enumerate(files):
        chunk.append(f.read_bytes().decode("utf-8", errors="replace"))
        size += len(chunk[-1])
        if size >= ENCODE_CHUNK_BYTES or i == len(files) - 1:
            for enc in tok.encode_batch_fast(chunk, add_special_tokens=False):
                parts.append(np.array([*enc.ids, eot], dtype=dtype))
            chunk, size = [], 0
    return np.concatenate(parts)


def _entropy(tokens: np.ndarray, vocab_size: int) -> float:
    counts = np.bincount(tokens, minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _split_by_file(files: list[pathlib.Path], val_fraction: float) -> tuple[list[int], list[bool]]:
    """``(order, is_val)``: the files' indices in sha256 order of their paths relative to their
    common folder, and which are held out (hash ``% 10_000 < val_fraction * 10_000``; at least
    one file each side when there are two or more; a single file is all train)."""
    if len(files) == 1:
        return [0], [False]
    root = os.path.commonpath([str(f.parent) for f in files])
    hashes = [
        int(hashlib.sha256(os.path.relpath(f, root).replace(os.sep, "/").encode()).hexdigest(), 16)
        for f in files
    ]
    is_val = [h % 10_000 < val_fraction * 10_000 for h in hashes]
    order = sorted(range(len(files)), key=hashes.__getitem__)
    if not any(is_val):
        is_val[order[0]] = True
    if all(is_val):
        is_val[order[-1]] = False
    return order, is_val


def _hold_out_tail(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """One file: the last ``val_fraction`` of its tokens (at least one) are the validation
    set."""
    n_val = max(1, round(len(tokens) * val_fraction))
    return tokens[:-n_val], tokens[-n_val:]


def _load(entry: pathlib.Path) -> Corpus:
    meta = json.loads((entry / "meta.json").read_text())
    return Corpus(
        train=np.load(entry / "train.npy", mmap_mode="r"),
        val=np.load(entry / "val.npy", mmap_mode="r"),
        vocab_size=meta["vocab_size"],
        tokenizer_path=entry / "tokenizer.json",
        unigram_entropy=meta["unigram_entropy"],
        n_files=meta["n_files"],
        n_bytes=meta["n_bytes"],
    )


def prepare_corpus(
    paths: list[str],
    tokenizer: str = "",
    vocab_size: int = 4096,
    val_fraction: float = 0.01,
    cache_dir: pathlib.Path | None = None,
) -> Corpus:
    """Tokenize the files of ``corpus_files(paths)`` into train/val token streams, with caching.

    Split by file: a file is held out when ``sha256(its path relative to the files' common
    folder) % 10_000 < val_fraction * 10_000``, so the split does not depend on where the corpus
    lives; at least one file goes to each side (the lowest-hash file is held out if none was).
    A single file is split by tokens instead: its last ``val_fraction`` of tokens are held out
    (its tokenizer is trained on the whole file).
    ``tokenizer == ""`` trains a byte-level BPE of ``vocab_size`` ids (``<|endoftext|>`` = id 0)
    on the train files; to bound the time it sees at most ``BPE_TRAIN_BYTES`` (8 MB) of text,
    whole train files taken in sha256 order (a deterministic, well-mixed subset). Otherwise
    ``tokenizer`` is a HF ``tokenizer.json`` to load, and ``vocab_size`` is its own.

    The result lives in ``<cache>/<key[:16]>/`` (cache = ``cache_dir``, ``$TETRAD_CACHE`` or
    ``~/.cache/tetrad``), keyed by the files' paths, sizes and mtimes, the tokenizer path and
    mtime, ``vocab_size`` and ``val_fraction``; it is written to a temporary folder and renamed
    into place, so it is either complete or absent. A cache hit only memory-maps the arrays.

    Raises DataError for missing, empty or binary inputs (:func:`corpus_files`),
    ``val_fraction`` outside (0, 1), ``vocab_size`` below 257, or an unreadable tokenizer file.
    """
    from tokenizers import Tokenizer

    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction {val_fraction} must be between 0 and 1 (exclusive)")
    if not tokenizer and vocab_size < 257:
        raise DataError(f"vocab_size {vocab_size} is too small: byte-level BPE needs >= 257")
    files = corpus_files(paths)
    tok_file = pathlib.Path(os.path.expanduser(tokenizer)).resolve() if tokenizer else None
    if tok_file is not None and not tok_file.is_file():
        raise DataError(f"tokenizer {tokenizer!r} does not exist: pass a tokenizer.json file")

    key = hashlib.sha256()
    key.update(f"v{FORMAT_VERSION}|{vocab_size}|{val_fraction!r}|".encode())
    key.update(f"{tok_file}|{tok_file.stat().st_mtime_ns}|".encode() if tok_file else b"|")
    for f in files:
        st = f.stat()
        key.update(f"{f}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    cache = pathlib.Path(
        cache_dir or os.environ.get("TETRAD_CACHE") or "~/.cache/tetrad"
    ).expanduser()
    entry = cache / key.hexdigest()[:16]
    if (entry / "meta.json").is_file():
        return _load(entry)

    order, is_val = _split_by_file(files, val_fraction)
    train_files = [f for f, v in zip(files, is_val, strict=True) if not v]
    val_files = [f for f, v in zip(files, is_val, strict=True) if v]

    if tok_file is not None:
        try:
            tok = Tokenizer.from_file(str(tok_file))
        except Exception as e:
            raise DataError(
                f"cannot read tokenizer {tokenizer!r} ({e}): pass a tokenizer.json"
            ) from e
    else:
        texts, size = [], 0
        for i in order:
            if not is_val[i] and size < BPE_TRAIN_BYTES:
                texts.append(files[i].read_bytes().decode("utf-8", errors="replace"))
                size += len(texts[-1])
        tok = _train_bpe(texts, vocab_size)
        del texts
    vocab = tok.get_vocab_size()
    eot = next((i for t in END_TOKENS if (i := tok.token_to_id(t)) is not None), 0)
    dtype = np.uint16 if vocab <= 65535 else np.uint32
    train = _encode(tok, train_files, eot, dtype)
    if val_files:
        val = _encode(tok, val_files, eot, dtype)
    else:
        train, val = _hold_out_tail(train, val_fraction)
    meta = dict(
        vocab_size=vocab,
        unigram_entropy=_entropy(train, vocab),
        n_files=len(files),
        n_bytes=sum(f.stat().st_size for f in files),
        n_val_files=len(val_files),
    )

    cache.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=cache))
    try:
        tok.save(str(tmp / "tokenizer.json"))
        np.save(tmp / "train.npy", train)
        np.save(tmp / "val.npy", val)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, entry)
        except OSError:  # another process finished first (or a stale incomplete folder)
            if not (entry / "meta.json").is_file():
                shutil.rmtree(entry, ignore_errors=True)
                os.rename(tmp, entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _load(entry)


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> torch.Tensor:
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))


def _check_len(tokens: np.ndarray, seq_len: int) -> None:
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"corpus has {len(tokens)} tokens, fewer than seq_len+1 = {seq_len + 1}: "
            "use a shorter --seq-len or more --data"
        )


def sample_batch(
    tokens: np.ndarray, step: int, batch: int, seq_len: int, seed: int
) -> torch.Tensor:
    """Draw ``batch`` random windows of ``seq_len + 1`` consecutive tokens: int64 ``[batch,
    seq_len + 1]``. Start positions come from a ``torch.Generator`` seeded with
    ``seed * 1_000_003 + step`` only, so any process gets the same batch for the same
    ``(seed, step)``. Raises DataError when ``tokens`` is shorter than ``seq_len + 1``.
    """
    _check_len(tokens, seq_len)
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) % 2**63)
    starts = torch.randint(0, len(tokens) - seq_len, (batch,), generator=g).numpy()
    return _windows(tokens, starts, seq_len)


def val_batches(tokens: np.ndarray, n_batches: int, batch: int, seq_len: int) -> list[torch.Tensor]:
    """The fixed validation set: ``n_batches`` int64 tensors ``[batch, seq_len + 1]`` whose
    ``n_batches * batch`` windows are evenly spaced from the start to the end of ``tokens``
    (non-overlapping whenever ``len(tokens) >= n_batches * batch * (seq_len + 1)``, overlapping
    otherwise). No randomness. Raises DataError when ``tokens`` is shorter than ``seq_len + 1``.
    """
    _check_len(tokens, seq_len)
    n = n_batches * batch
    starts = np.arange(n, dtype=np.int64) * (len(tokens) - seq_len - 1) // max(n - 1, 1)
    return [_windows(tokens, s, seq_len) for s in np.split(starts, n_batches)] if n else []
