"""Token streams over the memory-mapped shards, and the batches cut out of them.

A :class:`TokenStream` is the train (or validation) documents of a prepared folder laid end to
end: a list of ``[start, end)`` ranges of the concatenated shards, read through ``np.memmap``
(nothing is copied; only the windows a batch needs are read). :func:`sample_batch` and
:func:`val_batches` cut ``[batch, seq_len + 1]`` windows out of a stream (inputs ``[:, :-1]``,
next-token targets ``[:, 1:]``); they take any 1-D token array as well.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from tetrad.data.errors import DataError


class TokenStream:
    """Ranges of token shards seen as one 1-D sequence (indexable like a numpy array).

    Args:
        shards: 1-D token arrays (usually read-only ``np.memmap``), one dtype.
        ranges: int64 ``[n, 2]``: ``[start, end)`` ranges of the shards laid end to end, in the
            order the stream reads them.
    """

    def __init__(self, shards: list[np.ndarray], ranges: np.ndarray):
        self.shards = shards
        self.ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
        sizes = [len(s) for s in shards]
        self._shard_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        lengths = self.ranges[:, 1] - self.ranges[:, 0]
        self._starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.dtype = shards[0].dtype if shards else np.dtype(np.uint16)

    ndim = 1

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def physical(self, idx: np.ndarray) -> np.ndarray:
        """Positions in the concatenated shards of stream positions ``idx`` (any shape)."""
        seg = np.searchsorted(self._starts, idx, side="right") - 1
        return idx - self._starts[seg] + self.ranges[seg, 0]

    def take(self, idx: np.ndarray) -> np.ndarray:
        """The tokens at stream positions ``idx`` (int array of any shape, ``0 <= idx <
        len``), same shape, the shards' dtype.

        Raises:
            IndexError: a position outside the stream.
        """
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"token position outside a stream of {len(self)} tokens")
        phys = self.physical(idx)
        if len(self.shards) == 1:
            return np.asarray(self.shards[0][phys])
        shard = np.searchsorted(self._shard_starts, phys, side="right") - 1
        out = np.empty(idx.shape, dtype=self.dtype)
        for s in np.unique(shard):
            here = shard == s
            out[here] = self.shards[s][phys[here] - self._shard_starts[s]]
        return out

    def __getitem__(self, key):
        if isinstance(key, slice):
            return self.take(np.arange(*key.indices(len(self))))
        if isinstance(key, (int, np.integer)):
            return self.take(np.array(key + len(self) if key < 0 else key))[()]
        return self.take(key)

    def chunks(self, max_tokens: int = 1 << 24) -> Iterator[np.ndarray]:
        """The stream in order, in copies of at most ``max_tokens`` tokens."""
        for start, end in self.ranges:
            pos = start
            while pos < end:
                stop = min(end, pos + max_tokens)
                shard = int(np.searchsorted(self._shard_starts, pos, side="right") - 1)
                stop = min(stop, int(self._shard_starts[shard + 1]))
                off = self._shard_starts[shard]
                yield np.array(self.shards[shard][pos - off : stop - off])
                pos = stop

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        parts = list(self.chunks())
        out = np.concatenate(parts) if parts else np.zeros(0, self.dtype)
        return out.astype(dtype) if dtype is not None else out

    def bincount(self, minlength: int) -> np.ndarray:
        """int64 ``[minlength]``: how often each token id occurs in the stream."""
        counts = np.zeros(minlength, np.int64)
        for part in self.chunks():
            counts += np.bincount(part, minlength=minlength)[:minlength]
        return counts


def _windows(tokens, starts: np.ndarray, seq_len: int) -> torch.Tensor:
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))


def _check_len(tokens, seq_len: int) -> None:
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"corpus has {len(tokens)} tokens, fewer than seq_len+1 = {seq_len + 1}: "
            "use a shorter --seq-len or more --data"
        )


def sample_batch(tokens, step: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """Draw ``batch`` random windows of ``seq_len + 1`` consecutive tokens of ``tokens`` (a
    :class:`TokenStream` or 1-D array): int64 ``[batch, seq_len + 1]``. Start positions come
    from a ``torch.Generator`` seeded with ``seed * 1_000_003 + step`` only, so any process
    gets the same batch for the same ``(seed, step)``, whatever the grid, and a resumed run the
    batches the uninterrupted one would have had.

    Raises:
        DataError: ``tokens`` is shorter than ``seq_len + 1``.
    """
    _check_len(tokens, seq_len)
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) % 2**63)
    starts = torch.randint(0, len(tokens) - seq_len, (batch,), generator=g).numpy()
    return _windows(tokens, starts, seq_len)


def val_batches(tokens, n_batches: int, batch: int, seq_len: int) -> list[torch.Tensor]:
    """The fixed validation set: ``n_batches`` int64 tensors ``[batch, seq_len + 1]`` whose
    ``n_batches * batch`` windows are evenly spaced from the start to the end of ``tokens``
    (non-overlapping whenever ``len(tokens) >= n_batches * batch * (seq_len + 1)``, overlapping
    otherwise). No randomness.

    Raises:
        DataError: ``tokens`` is shorter than ``seq_len + 1``.
    """
    _check_len(tokens, seq_len)
    n = n_batches * batch
    starts = np.arange(n, dtype=np.int64) * (len(tokens) - seq_len - 1) // max(n - 1, 1)
    return [_windows(tokens, s, seq_len) for s in np.split(starts, n_batches)] if n else []
