"""The tokenizer of a preparation: a ``tokenizer.json`` loaded as is, or a byte-level BPE trained
on the corpus (HF ``tokenizers``), its end-of-document token and the token dtype."""

from __future__ import annotations

import hashlib
import os
import pathlib

from tetrad.data.encode import Settings, record_texts
from tetrad.data.errors import DataError
from tetrad.data.readers import START, batches, kind_of, text_pieces
from tetrad.data.sources import TEXT, Source
from tetrad.data.split import BUCKETS, held_out, path_keys

EOT = "<|endoftext|>"
END_TOKENS = (EOT, "<|end_of_text|>", "</s>")
"""The end-of-document token appended to each document: ours, then Llama 3's and Llama 2's
(the first the tokenizer has; id 0 if none)."""
BPE_TRAIN_BYTES = 8_000_000
"""The BPE is trained on at most about this many characters of train text."""


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 (hex) of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_tokenizer(path: str | os.PathLike):
    """The ``tokenizers.Tokenizer`` of a ``tokenizer.json`` file.

    Raises:
        DataError: the file is missing or not a tokenizer.
    """
    from tokenizers import Tokenizer

    p = pathlib.Path(os.path.expanduser(str(path)))
    if not p.is_file():
        raise DataError(f"tokenizer {str(path)!r} does not exist: pass a tokenizer.json file")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:
        raise DataError(f"cannot read tokenizer {str(path)!r} ({e}): pass a tokenizer.json") from e


def end_token(tok) -> int:
    """Id of the first of :data:`END_TOKENS` that ``tok`` has, else 0."""
    return next((i for t in END_TOKENS if (i := tok.token_to_id(t)) is not None), 0)


def token_dtype(vocab_size: int) -> str:
    """``uint16`` for vocabularies of at most 65,535 ids, else ``uint32`` (numpy names)."""
    return "uint16" if vocab_size <= 65535 else "uint32"


def train_bpe(texts: list[str], vocab_size: int):
    """A byte-level BPE of ``vocab_size`` ids trained on ``texts``; ``<|endoftext|>`` is id 0.

    Raises:
        DataError: ``vocab_size`` below 257 (the 256 bytes and the end token).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise DataError(f"vocab_size {vocab_size} is too small: byte-level BPE needs >= 257")
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


def _text_sample(sources: list[Source], val_fraction: float, limit: int) -> list[str]:
    """Whole train text files in the order of their split key until ``limit`` characters (a
    file above the piece size contributes its pieces); the text files' split is
    :func:`tetrad.data.split.held_out` over files."""
    texts: list[str] = []
    keys = path_keys([s.path for s in sources])
    if not keys:
        return texts
    buckets, ranks = zip(*keys, strict=True)
    is_val = held_out(list(buckets), list(ranks), val_fraction)
    size = 0
    for i in sorted(range(len(sources)), key=lambda i: ranks[i]):
        if is_val[i]:
            continue
        for piece in text_pieces(sources[i].path, 0, 0):
            if size >= limit:
                return texts
            texts.append(piece.payload.decode("utf-8", errors="replace"))
            size += len(texts[-1])
    return texts


def bpe_sample(
    sources: list[Source], val_fraction: float, field: str, encoding_errors: str
) -> list[str]:
    """The text the BPE is trained on: at most about :data:`BPE_TRAIN_BYTES` characters of
    train documents, never validation ones. First whole text files in the order of their split
    key (a deterministic, well-mixed subset), then records in input order.

    Raises:
        DataError: as :func:`tetrad.data.encode.encode` for the records read.
    """
    text = [s for s in sources if s.format == TEXT]
    texts = _text_sample(text, val_fraction, BPE_TRAIN_BYTES)
    size = sum(len(t) for t in texts)
    records = [s for s in sources if s.format != TEXT]
    if size >= BPE_TRAIN_BYTES or not records:
        return texts
    n = len(records)
    s = Settings(
        tuple(str(r.path) for r in records),
        tuple(kind_of(r.format) for r in records),
        (None,) * n,
        field,
        encoding_errors,
        0,
        "uint32",
    )
    for batch in batches(records, START, field):
        for t, (bucket, _) in record_texts(batch, s):
            if bucket >= val_fraction * BUCKETS:
                texts.append(t)
                size += len(t)
                if size >= BPE_TRAIN_BYTES:
                    return texts
    return texts
