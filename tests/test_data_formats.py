"""The same documents as text files, JSONL (plain, gzip, zstd), Parquet and a ``datasets`` folder:
identical prepared tokens; workers, shards, resume after a kill, bad data, training on each
format, TensorBoard scalars. One small corpus and one tokenizer serve every test."""

from __future__ import annotations

import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tetrad.data import readers
from tetrad.data.corpus import open_corpus, prepare_corpus
from tetrad.data.errors import DataError
from tetrad.data.loader import sample_batch
from tetrad.data.prepare import prepare, summary_line
from tetrad.data.tokenizer import train_bpe

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ("text", "jsonl", "jsonl.gz", "jsonl.zst", "jsonl folder", "parquet", "datasets")


def _documents() -> list[str]:
    """40 documents of Python-like text (some non-ASCII; one empty, which is skipped)."""
    rnd = random.Random(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "café", "✓"]
    docs = []
    for i in range(40):
        lines = [f"def f{i}_{j}(x):\n    return x + {rnd.randint(0, 99)}\n" for j in range(8)]
        lines += [" ".join(rnd.choice(words) for _ in range(9)) + "\n" for _ in range(8)]
        docs.append("".join(lines))
    docs[7] = ""
    return docs


def _write_jsonl(path: Path, docs: list[str], opener=open) -> None:
    with opener(path, "wt", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, "text": d}) + "\n")


def _write_zst(path: Path, docs: list[str]) -> None:
    """Two zstd frames (a multi-frame file is read whole)."""
    import zstandard

    cctx = zstandard.ZstdCompressor()
    lines = [json.dumps({"text": d}) + "\n" for d in docs]
    half = len(lines) // 2
    frames = [cctx.compress("".join(part).encode()) for part in (lines[:half], lines[half:])]
    path.write_bytes(b"".join(frames))


def _write_formats(root: Path, docs: list[str]) -> dict[str, Path]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = {f: root / f.replace(" ", "_") for f in FORMATS}
    paths["text"].mkdir()
    for i, d in enumerate(docs):
        (paths["text"] / f"doc{i:03d}.txt").write_text(d, encoding="utf-8")
    paths["jsonl"] = root / "docs.jsonl"
    _write_jsonl(paths["jsonl"], docs)
    paths["jsonl.gz"] = root / "docs.jsonl.gz"
    _write_jsonl(paths["jsonl.gz"], docs, gzip.open)
    paths["jsonl.zst"] = root / "docs.jsonl.zst"
    _write_zst(paths["jsonl.zst"], docs)
    paths["jsonl folder"].mkdir()
    _write_jsonl(paths["jsonl folder"] / "a.jsonl", docs[:15])
    _write_jsonl(paths["jsonl folder"] / "b.jsonl", docs[15:])
    paths["parquet"] = root / "docs.parquet"
    table = pa.table({"id": list(range(len(docs))), "text": docs})
    pq.write_table(table, paths["parquet"], row_group_size=7)
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(paths["datasets"]))
    return paths


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The documents, a tokenizer trained on them, every format, and each prepared."""
    root = tmp_path_factory.mktemp("formats")
    docs = _documents()
    tok = root / "tokenizer.json"
    train_bpe(docs, 300).save(str(tok))
    paths = _write_formats(root, docs)
    prepared = {f: root / "prep" / f.replace(" ", "_") for f in FORMATS}
    for f, p in paths.items():
        prepare([str(p)], prepared[f], str(tok))
    return root, docs, tok, paths, prepared


def _shard_arrays(folder: Path) -> tuple[bytes, np.ndarray]:
    with np.load(folder / "shards" / "000000.npz") as z:
        ends = z["doc_ends"]
    return (folder / "shards" / "000000.bin").read_bytes(), ends


def test_every_format_gives_the_same_tokens(world):
    _, docs, tok, paths, prepared = world
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(tok))
    expected = [[*t.encode(d, add_special_tokens=False).ids, 0] for d in docs if d]
    want = np.array([i for ids in expected for i in ids], np.uint16)
    tokens, ends = _shard_arrays(prepared["text"])
    assert tokens == want.tobytes()
    assert ends.tolist() == np.cumsum([len(e) for e in expected]).tolist()
    for f in FORMATS[1:]:
        assert _shard_arrays(prepared[f])[0] == tokens, f
        assert _shard_arrays(prepared[f])[1].tolist() == ends.tolist(), f
        index = json.loads((prepared[f] / "index.json").read_text())
        assert index["documents"] == 39 and index["empty_documents"] == 1, f
    # records are keyed by content: the same split in every record format
    splits = {f: open_corpus(prepared[f], 0.3) for f in FORMATS[1:]}
    vals = {f: np.asarray(c.val).tobytes() for f, c in splits.items()}
    assert len(set(vals.values())) == 1


def test_workers_and_resume_after_a_kill_give_the_same_shards(world, tmp_path, monkeypatch):
    """Many small shards: 0 and 2 workers, and a run killed (SIGKILL) after its first shard
    then run again, write the same files; the batch at step t is the same."""
    root, _, tok, paths, _ = world
    monkeypatch.setattr(readers, "BATCH_BYTES", 2048)
    args = dict(tokenizer=str(tok), shard_bytes=4096)
    whole = tmp_path / "whole"
    prepare([str(paths["jsonl.zst"])], whole, workers=0, **args)
    two = tmp_path / "two"
    prepare([str(paths["jsonl.zst"])], two, workers=2, **args)
    killed = tmp_path / "killed"
    code = (
        "import sys; import tetrad.data.readers as r; r.BATCH_BYTES = 2048\n"
        "from tetrad.cli import main; sys.exit(main(sys.argv[1:]))\n"
    )
    cmd = [sys.executable, "-c", code, "prepare", str(paths["jsonl.zst"]), "--out", str(killed)]
    cmd += ["--tokenizer", str(tok), "--workers", "1", "--shard-mb", str(4096 / 2**20)]
    log = (tmp_path / "killed.log").open("w")  # the orphaned tracker's leak warning lands here
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    second = killed / "shards" / "000001.bin"  # shard 0 complete, shard 1 begun
    deadline = time.monotonic() + 60
    while not second.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    log.close()
    done = (killed / "index.json").exists()
    assert second.exists() and not done, (tmp_path / "killed.log").read_text()
    prepare([str(paths["jsonl.zst"])], killed, workers=0, **args)
    names = sorted(p.name for p in (whole / "shards").iterdir())
    assert len(names) >= 3 * 4  # .bin, .npz and .json of at least 4 shards
    for other in (two, killed):
        assert sorted(p.name for p in (other / "shards").iterdir()) == names
        for n in names:
            assert (other / "shards" / n).read_bytes() == (whole / "shards" / n).read_bytes(), n
    corpora = [open_corpus(f, 0.3) for f in (whole, two, killed)]
    for step in range(4):
        b = [sample_batch(c.train, step, 4, 16, seed=1).numpy() for c in corpora]
        assert np.array_equal(b[0], b[1]) and np.array_equal(b[0], b[2])


def test_a_large_text_file_is_read_in_pieces_with_the_same_tokens(world, tmp_path, monkeypatch):
    """Pieces cut after a newline followed by a non-space byte change no byte-level BPE token;
    the file stays one document (one end token)."""
    _, docs, tok, _, prepared = world
    big = tmp_path / "big.txt"
    big.write_text("".join(docs) * 3, encoding="utf-8")
    whole = prepare([str(big)], tmp_path / "whole", str(tok))
    monkeypatch.setattr(readers, "PIECE_BYTES", 700)
    monkeypatch.setattr(readers, "BATCH_BYTES", 1500)
    pieces = prepare([str(big)], tmp_path / "pieces", str(tok), shard_bytes=2000)
    assert whole["documents"] == pieces["documents"] == 1 and len(pieces["shards"]) > 3
    a = open_corpus(tmp_path / "whole", 0.1)
    b = open_corpus(tmp_path / "pieces", 0.1)
    assert np.asarray(a.train).tobytes() == np.asarray(b.train).tobytes()
    assert np.asarray(a.val).tobytes() == np.asarray(b.val).tobytes()


def _error(tmp_path, inputs, tok, **kw) -> str:
    with pytest.raises(DataError) as e:
        prepare(
            [str(p) for p in inputs], tmp_path / f"out{len(list(tmp_path.iterdir()))}", tok, **kw
        )
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_data_gets_one_line(world, tmp_path):
    root, docs, tok, paths, prepared = world
    tok = str(tok)
    other = tmp_path / "other.jsonl"
    other.write_text('{"id": 1, "content": "x"}\n')
    assert "has no field 'text' (fields: id, content): pass --text-field" in _error(
        tmp_path, [other], tok
    )
    assert "no field 'body' (fields: id, text)" in _error(
        tmp_path, [paths["parquet"]], tok, text_field="body"
    )
    assert "no field 'body' (fields: text)" in _error(
        tmp_path, [paths["datasets"]], tok, text_field="body"
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9 \xff!"}\n{"text": ""}\n')
    msg = _error(tmp_path, [bad], tok, encoding_errors="strict")
    assert "bad.jsonl' line 2 (byte 28) is not UTF-8" in msg
    index = prepare([str(bad)], tmp_path / "replaced", tok)
    assert index["non_utf8_documents"] == 1 and index["non_utf8_bytes"] == 2
    assert index["empty_documents"] == 1 and index["documents"] == 2
    (tmp_path / "not_json.jsonl").write_text('{"text": "a"}\nnot json\n')
    assert "line 2 (byte 14) is not JSON" in _error(tmp_path, [tmp_path / "not_json.jsonl"], tok)
    (tmp_path / "all_empty.jsonl").write_text('{"text": ""}\n')
    assert "no text: 1 empty document" in _error(tmp_path, [tmp_path / "all_empty.jsonl"], tok)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine\n")
    with pytest.raises(DataError, match="busy' is not empty"):
        prepare([str(paths["jsonl"])], tmp_path / "busy", tok)
    # a prepared folder: with another tokenizer, with other inputs, unfinished
    other_tok = tmp_path / "other_tok.json"
    train_bpe(docs[:5], 280).save(str(other_tok))
    with pytest.raises(DataError, match="prepared with another tokenizer"):
        prepare_corpus([str(prepared["jsonl"])], str(other_tok))
    with pytest.raises(DataError, match="is a prepared folder: pass it alone"):
        prepare_corpus([str(prepared["jsonl"]), str(paths["jsonl"])], str(tok))
    with pytest.raises(DataError, match="holds data prepared from other inputs"):
        prepare([str(paths["parquet"])], prepared["jsonl"], tok)
    (tmp_path / "unfinished").mkdir()
    (tmp_path / "unfinished" / "job.json").write_text('{"format": "tetrad-tokens"}')
    with pytest.raises(DataError, match="unfinished preparation"):
        prepare_corpus([str(tmp_path / "unfinished")])
    # a preparation that stopped before its first shard does not block the corrected command
    with pytest.raises(DataError, match="no field 'body'"):
        prepare([str(paths["jsonl"])], tmp_path / "retry", tok, text_field="body")
    assert (tmp_path / "retry" / "job.json").is_file()
    assert prepare([str(paths["jsonl"])], tmp_path / "retry", tok)["documents"] > 0


@pytest.mark.parametrize("fmt", ["jsonl.zst", "jsonl.gz"])
@pytest.mark.parametrize("cut", [0.5, -3])
def test_a_cut_compressed_file_is_named(world, tmp_path, fmt, cut):
    """A file cut short stops the preparation naming it, alone or beside a good file (a
    ``.zst`` cut in its last frame read as shorter, or as "no text" when alone)."""
    root, docs, tok, paths, prepared = world
    blob = paths[fmt].read_bytes()
    cut_file = tmp_path / f"cut.{fmt}"
    cut_file.write_bytes(blob[: int(len(blob) * cut) if cut > 0 else cut])
    for inputs in ([cut_file], [paths["jsonl"], cut_file]):
        msg = _error(tmp_path, inputs, str(tok))
        assert f"cut.{fmt}' is damaged" in msg and "--skip-bad-files" in msg, msg
    # --skip-bad-files: left out, counted and named; the shards are the good file's alone
    index = prepare([str(paths["jsonl"]), str(cut_file)], tmp_path / "kept", str(tok), **SKIP)
    assert index["job"]["skipped"] == [str(cut_file)]
    (tokens, ends), (want_tokens, want_ends) = (
        _shard_arrays(tmp_path / "kept"),
        _shard_arrays(prepared["jsonl"]),
    )
    assert tokens == want_tokens and np.array_equal(ends, want_ends)
    line = summary_line(index, tmp_path / "kept")
    assert f"left out 1 damaged file(s): {cut_file}" in line, line
    assert "every --data input is damaged" in _error(tmp_path, [cut_file], str(tok), **SKIP)


SKIP = {"skip_bad_files": True}


def _train_each(configs) -> None:
    from tetrad.train import trainer

    for cfg in configs:
        trainer.train(cfg)


def test_train_on_each_format_and_tensorboard(world, tmp_path, monkeypatch):
    """Two steps on every format and on a prepared folder (one rank); the record formats share
    their split, so their losses agree exactly; TensorBoard gets the metrics' scalars."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.distributed import run_distributed
    from tetrad.train.config import load_config

    _, _, tok, paths, prepared = world
    monkeypatch.setenv("TETRAD_CACHE", str(tmp_path / "cache"))
    inputs = {**paths, "prepared": prepared["jsonl.zst"]}
    configs = {}
    for name, data in inputs.items():
        configs[name] = load_config(
            None,
            {
                "model": "dim=32,n_layers=1,n_heads=2,n_kv_heads=1,ffn_dim=64",
                "grid": "1,1,1,1",
                "steps": 2,
                "global_batch": 4,
                "micro_batch": 2,
                "seq_len": 16,
                "data": [str(data)],
                "tokenizer": str(tok),
                "val_fraction": 0.3,
                "run_dir": str(tmp_path / name.replace(" ", "_")),
                "val_every": 2,
                "val_batches": 1,
                "warmup_steps": 1,
                "peak_flops": 1e9,
                "tensorboard": name == "prepared",
            },
        )
    run_distributed(_train_each, 1, list(configs.values()))
    rows = {}
    for name, cfg in configs.items():
        lines = Path(cfg.checkpoint.run_dir, "metrics.jsonl").read_text().splitlines()
        rows[name] = [json.loads(line) for line in lines]
        assert [r["step"] for r in rows[name]] == [1, 2], name
    losses = {n: [r["loss"] for r in rows[n]] + [rows[n][1]["val_loss"]] for n in rows}
    assert all(losses[n] == losses["jsonl"] for n in inputs if n != "text"), losses
    acc = EventAccumulator(str(tmp_path / "prepared" / "tensorboard"), {"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "val/loss", "train/lr", "train/grad_norm", "perf/mfu"} <= tags
    assert {"perf/tokens_per_s", "memory/peak_bytes", "perf/step_time_s"} <= tags
    got = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    want = [(r["step"], r["loss"]) for r in rows["prepared"]]
    assert got == [(s, pytest.approx(v, rel=1e-6)) for s, v in want]
    assert [e.step for e in acc.Scalars("val/loss")] == [2]


def test_prepare_command(world, tmp_path, capsys):
    from tetrad import cli

    _, _, tok, paths, prepared = world
    out = tmp_path / "p"
    argv = ["prepare", str(paths["jsonl.gz"]), "--tokenizer", str(tok), "--out", str(out)]
    assert cli.main([*argv, "--workers", "0"]) == 0
    assert "tetrad: prepared 39 documents (8,741 tokens) from 1 file(s)" in capsys.readouterr().out
    assert _shard_arrays(out)[0] == _shard_arrays(prepared["jsonl"])[0]
    assert cli.main([*argv, "--workers", "0"]) == 0
    assert "already holds this preparation" in capsys.readouterr().out
    assert cli.main(["prepare", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tetrad: error: data path '")


def test_a_preparation_inside_its_input_folder_is_not_read_as_input(world, tmp_path):
    _, _, tok, paths, _ = world
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "docs.jsonl").write_bytes(paths["jsonl"].read_bytes())
    first = prepare([str(folder)], folder / "prepared", str(tok))
    assert prepare([str(folder)], folder / "prepared", str(tok)) == first  # same job: as is


def test_train_passes_skip_bad_files(monkeypatch):
    """``tetrad train --skip-bad-files`` (config ``[data] skip_bad_files``) reaches the
    preparation of its ``--data``."""
    from tetrad.train import preflight
    from tetrad.train.config import load_config

    got = {}
    monkeypatch.setattr(preflight, "prepare_corpus", lambda *a, **kw: got.update(kw))
    for given, want in (({}, False), ({"skip_bad_files": True}, True)):
        preflight.load_corpus(load_config(None, given))
        assert got["skip_bad_files"] is want
