"""Token data: sources, split by file, tokenizers, .bin files and deterministic batches."""
import json
import math
from pathlib import Path

import numpy as np
import pytest

from zeroflow.config.schema import DataConfig
from helpers import load_script
from zeroflow.data import (ByteTokenizer, bits_per_byte, eval_batches, list_source_files,
                           load_data, load_tokenizer, stdlib_root, train_batch,
                           train_sentencepiece)

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def prepare_data():
    return load_script("prepare_data")


@pytest.fixture
def text_folder(tmp_path):
    """24 small files, each with a unique marker, plus files the walker must skip."""
    root = tmp_path / "corpus"
    for i in range(24):
        path = root / f"dir{i % 3}" / f"doc{i:02d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"@@doc{i:02d}@@ " + f"line {i} of some text, café\n" * 20)
    (root / ".hidden").write_text("@@hidden@@\n")
    (root / "blob.dat").write_bytes(b"\0\1\2@@binary@@")
    (root / "latin1.txt").write_bytes("@@latin@@ caf\xe9".encode("latin-1"))
    return root


@pytest.fixture
def tokens():
    """Tokens equal to their own position (mod 2**16): a window shows where it starts."""
    return np.arange(5000, dtype=np.uint32)


def test_byte_tokenizer_round_trip():
    tok = load_tokenizer("byte")
    text = "def f(x):\n    return x  # é 中文 🙂\n"
    ids = tok.encode(text)
    assert tok.vocab_size == 256 and max(ids) < 256 and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert np.array_equal(tok.encode_array(text), ids)
    assert tok.decode([0xE4, 0xB8]) == "\ufffd"  # a cut character decodes, replaced
    with pytest.raises(ValueError, match="tokenizer not found"):
        load_tokenizer("missing.model")


def test_sentencepiece_round_trip(tmp_path):
    lines = (Path(stdlib_root(), "json", "decoder.py").read_text().splitlines()
             + Path(stdlib_root(), "textwrap.py").read_text().splitlines())
    tok = train_sentencepiece(lines, tmp_path / "sp.model", vocab_size=400)
    assert tok.vocab_size == 400 and load_tokenizer(tmp_path / "sp.model").vocab_size == 400
    text = "class Foo:\n    def bar(self):\n\n        return  'é'\t# 中\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert np.array_equal(tok.encode_array(text), ids)


def test_stdlib_discovery_finds_many_files_without_site_packages():
    files = list_source_files("stdlib")
    names = [f.name for f in files]
    assert len(files) > 500 and sum(f.size for f in files) > 10_000_000
    assert names == sorted(names) and "os.py" in names and "json/decoder.py" in names
    assert all(name.endswith(".py") for name in names)
    assert not any(part in name.split("/") for name in names
                   for part in ("site-packages", "dist-packages", "__pycache__"))


def test_stdlib_corpus_capped_and_deterministic():
    cfg = DataConfig(max_bytes=400_000, val_fraction=0.1)
    data = load_data(cfg, seq_len=64)
    total = len(data.train) + len(data.val)
    assert 400_000 <= total <= 400_000 + len(data.train_files) + len(data.val_files)  # + separators
    assert data.vocab_size == 256 and data.tokens_per_byte == 1.0 and data.val_files
    assert not set(data.train_files) & set(data.val_files)
    again = load_data(cfg, seq_len=64)
    assert np.array_equal(again.train, data.train) and np.array_equal(again.val, data.val)


def test_split_by_file_never_shares_a_file(text_folder):
    data = load_data(DataConfig(source=str(text_folder), val_fraction=0.25), seq_len=32)
    train, val = bytes(data.train), bytes(data.val)
    assert data.val_files and not set(data.train_files) & set(data.val_files)
    assert set(data.train_files) | set(data.val_files) == {f"dir{i % 3}/doc{i:02d}.txt"
                                                           for i in range(24)}
    for i in range(24):
        marker = f"@@doc{i:02d}@@".encode()
        assert (marker in train) != (marker in val)
        assert (marker in val) == (f"dir{i % 3}/doc{i:02d}.txt" in data.val_files)
    for skipped in (b"@@hidden@@", b"@@binary@@", b"@@latin@@"):
        assert skipped not in train + val
    # The split follows names only: adding a file does not move the others.
    (text_folder / "dir0" / "zzz.txt").write_text("@@new@@\n" * 50)
    grown = load_data(DataConfig(source=str(text_folder), val_fraction=0.25), seq_len=32)
    assert set(data.val_files) <= set(grown.val_files)


def test_single_file_holds_out_its_tail(tmp_path):
    path = tmp_path / "book.txt"
    text = "".join(f"line {i}\n" for i in range(1000))
    path.write_text(text)
    data = load_data(DataConfig(source=str(path), val_fraction=0.1), seq_len=16)
    train, val = bytes(data.train)[:-1].decode(), bytes(data.val)[:-1].decode()  # - separators
    assert train + val == text and train.endswith("\n") and val.startswith("line 9")
    assert len(val) == pytest.approx(0.1 * len(text), abs=10)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        load_data(DataConfig(source=str(path), val_fraction=0.1), seq_len=5000)
    with pytest.raises(FileNotFoundError, match="data source not found"):
        load_data(DataConfig(source=str(tmp_path / "nope")), seq_len=16)


def test_train_batch_is_a_function_of_seed_and_step(tokens):
    kw = dict(global_batch=8, seq_len=31, seed=3)
    batch = train_batch(tokens, 5, **kw)
    assert batch.shape == (8, 32) and batch.dtype == np.int32
    assert (np.diff(batch, axis=1) == 1).all()  # every row is a window of the corpus
    assert batch[:, -1].max() < len(tokens)
    assert np.array_equal(batch, train_batch(tokens, 5, **kw))
    assert not np.array_equal(batch, train_batch(tokens, 6, **kw))
    assert not np.array_equal(batch, train_batch(tokens, 5, **{**kw, "seed": 4}))
    # A run resumed at step 3 sees what an uninterrupted run sees at step 3.
    uninterrupted = [train_batch(tokens, s, **kw) for s in range(5)]
    assert np.array_equal(uninterrupted[3], train_batch(tokens, 3, **kw))


def test_process_shards_tile_the_global_batch(tokens):
    kw = dict(global_batch=12, seq_len=16, seed=0)
    whole = train_batch(tokens, 7, **kw)
    shards = [train_batch(tokens, 7, process_index=p, process_count=4, **kw) for p in range(4)]
    assert all(s.shape == (3, 17) for s in shards)
    assert np.array_equal(np.concatenate(shards), whole)
    assert len(set(whole[:, 0].tolist())) == 12  # no repeated window at this seed and step
    starts = [set(s[:, 0].tolist()) for s in shards]
    assert all(not starts[a] & starts[b] for a in range(4) for b in range(a + 1, 4))


def test_batch_errors(tokens):
    with pytest.raises(ValueError, match="multiple of process_count"):
        train_batch(tokens, 0, global_batch=10, seq_len=8, seed=0, process_count=4)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        train_batch(tokens[:8], 0, global_batch=2, seq_len=8, seed=0)
    assert train_batch(tokens[:9], 0, global_batch=2, seq_len=8, seed=0).shape == (2, 9)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        eval_batches(tokens[:5], num_batches=1, global_batch=2, seq_len=8)


def test_eval_batches_fixed_and_sharded(tokens):
    kw = dict(num_batches=3, global_batch=4, seq_len=99)
    batches = eval_batches(tokens, **kw)
    assert len(batches) == 3 and all(b.shape == (4, 100) for b in batches)
    assert np.array_equal(np.stack(batches), np.stack(eval_batches(tokens, **kw)))
    starts = np.sort(np.concatenate([b[:, 0] for b in batches]))
    assert starts[0] == 0 and starts[-1] == len(tokens) - 100  # spread over the whole split
    for i in range(3):
        halves = [eval_batches(tokens, process_index=p, process_count=2, **kw)[i] for p in (0, 1)]
        assert np.array_equal(np.concatenate(halves), batches[i])
    assert eval_batches(tokens, num_batches=0, global_batch=4, seq_len=8) == []


def test_bits_per_byte():
    assert bits_per_byte(math.log(2), 1.0) == pytest.approx(1.0)
    assert bits_per_byte(2.0, 0.25) == pytest.approx(0.5 / math.log(2))


def test_prepare_data_bytes_round_trip(prepare_data, text_folder, tmp_path):
    out = tmp_path / "tokens"
    assert prepare_data.main(["--input", str(text_folder), "--out", str(out),
                              "--val-fraction", "0.25", "--quiet"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint8" and meta["vocab_size"] == 256 and meta["tokenizer"] == "byte"
    from_text = load_data(DataConfig(source=str(text_folder), val_fraction=0.25), seq_len=32)
    for source in (out, out / "train.bin"):
        from_bin = load_data(DataConfig(source=str(source)), seq_len=32)
        assert isinstance(from_bin.train, np.memmap)
        assert np.array_equal(from_bin.train, from_text.train)
        assert np.array_equal(from_bin.val, from_text.val)
        assert from_bin.tokens_per_byte == 1.0
    kw = dict(global_batch=4, seq_len=32, seed=0)
    expected = train_batch(from_text.train, 1, **kw)
    assert np.array_equal(train_batch(from_bin.train, 1, **kw), expected)


def test_lone_bin_with_sidecar_and_without(tmp_path):
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "x.bin")
    with pytest.raises(ValueError, match="no metadata"):
        load_data(DataConfig(source=str(tmp_path / "x.bin")), seq_len=8)
    (tmp_path / "x.bin.json").write_text(json.dumps({
        "format": "zeroflow-tokens", "version": 1, "dtype": "uint16", "vocab_size": 256,
        "tokenizer": "byte", "splits": {"train": {"file": "x.bin"}}}))
    data = load_data(DataConfig(source=str(tmp_path / "x.bin"), val_fraction=0.1), seq_len=8)
    assert len(data.train) == 900 and data.val[0] == 900


def test_prepare_data_sentencepiece(prepare_data, tmp_path):
    corpus = tmp_path / "code"
    corpus.mkdir()
    for name in ("textwrap.py", "json/decoder.py", "json/encoder.py", "shlex.py", "fnmatch.py"):
        (corpus / name.replace("/", "_")).write_text(Path(stdlib_root(), name).read_text())
    out = tmp_path / "sp"
    assert prepare_data.main(["--input", str(corpus), "--out", str(out), "--tokenizer",
                              "sentencepiece", "--vocab-size", "500", "--val-fraction", "0.3",
                              "--quiet"]) == 0
    data = load_data(DataConfig(source=str(out)), seq_len=32)
    assert data.vocab_size == 500 and data.train.dtype == np.uint16
    assert 0.1 < data.tokens_per_byte < 0.9  # fewer tokens than bytes
    text = load_data(DataConfig(source=str(corpus), val_fraction=0.3), seq_len=32)
    assert data.tokenizer.decode(data.val) == bytes(text.val).decode()
    assert (out / "tokenizer.model").is_file()


def test_prepare_data_missing_input(prepare_data, tmp_path, capsys):
    assert prepare_data.main(["--input", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"prepare_data: error: input path not found: {tmp_path / 'nope'}"


def test_byte_tokenizer_decodes_a_batch_back_to_text(text_folder):
    data = load_data(DataConfig(source=str(text_folder), val_fraction=0.25), seq_len=32)
    row = train_batch(data.train, 0, global_batch=1, seq_len=200, seed=0)[0]
    assert ByteTokenizer().decode(row) in bytes(data.train).decode()
