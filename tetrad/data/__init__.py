"""Training data: inputs in several formats -> token shards on disk -> fixed-shape batches.

One concept per module, each imported on its own (this package imports nothing, so the
tokenizing worker processes load neither torch nor the loader):

- :mod:`~tetrad.data.sources`: what ``--data`` names: text files, JSONL (plain, gzip, zstd),
  Parquet, a Hugging Face ``datasets`` folder (``save_to_disk``), or a prepared folder;
- :mod:`~tetrad.data.readers`: each format streamed as documents, grouped into batches that
  carry where they end (the cursor a resumed preparation starts from);
- :mod:`~tetrad.data.encode`: bytes -> text -> token ids, in worker processes;
- :mod:`~tetrad.data.tokenizer`: load a ``tokenizer.json`` or train the byte-level BPE;
- :mod:`~tetrad.data.shards`: memory-mapped token shards and the folder's ``index.json``;
- :mod:`~tetrad.data.prepare`: ``tetrad prepare``: parallel, bounded memory, resumable;
- :mod:`~tetrad.data.split`: the deterministic train/validation split of the documents;
- :mod:`~tetrad.data.loader`: token streams over the shards, ``sample_batch``,
  ``val_batches``;
- :mod:`~tetrad.data.corpus`: what ``tetrad train`` loads: a prepared folder, or ``--data``
  prepared into the cache.
"""
