"""Records as training data: every source kind reads the same records, bad records give one
readable line (counted, or stopping the run), packed batches keep examples whole with
restarting positions, and the Grain loader is deterministic, resumable and sharded."""
import json

import numpy as np
import pytest

from zeroflow.cli import train as train_cli
from zeroflow.config.schema import DataConfig
from zeroflow.data import iter_records, load_data
from zeroflow.data.packing import packed_batches, packing_efficiency
from helpers import load_script

pytestmark = pytest.mark.fast

RECORDS = [{"prompt": f"Q{i}: what is {i} + {i}?", "completion": f" {2 * i}."} for i in range(40)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """The demo's tokenizer and chat template: scripts/make_tiny_hf.py's defaults (2 s)."""
    folder = tmp_path_factory.mktemp("tokenizer")
    load_script("make_tiny_hf").train_tokenizer(folder, vocab_size=512, max_bytes=2_000_000)
    return folder


def _write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_every_source_kind_reads_the_same_records(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    sources = {
        "jsonl": _write_jsonl(tmp_path / "a.jsonl", RECORDS),
        "json": tmp_path / "a.json",
        "parquet": tmp_path / "a.parquet",
        "folder": tmp_path / "folder",
        "save_to_disk": tmp_path / "saved",
        "dataset_dict": tmp_path / "saved_dict",
    }
    sources["json"].write_text(json.dumps(RECORDS))
    pq.write_table(pa.Table.from_pylist(RECORDS), sources["parquet"])
    _write_jsonl(sources["folder"] / "part-0.jsonl", RECORDS[:25])
    _write_jsonl(sources["folder"] / "sub" / "part-1.jsonl", RECORDS[25:])
    dataset = datasets.Dataset.from_list(RECORDS)
    dataset.save_to_disk(sources["save_to_disk"])
    datasets.DatasetDict({"train": dataset}).save_to_disk(sources["dataset_dict"])
    for kind, source in sources.items():
        assert [r.value for r in iter_records(source)] == RECORDS, kind
    with pytest.raises(ValueError, match="holds no records"):
        list(iter_records(tmp_path / "folder" / "sub" / ".."  / "missing"))


# (record, problem reported) for format=chat with seq_len 64; the first record is fine.
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
BAD = [
    ('{"messages": [', "invalid JSON"),
    ('[1, 2]', "not a JSON object"),
    ({"text": "no messages"}, "missing field 'messages'"),
    ({"messages": "hi"}, "field 'messages' is not a list"),
    ({"messages": []}, "empty conversation"),
    ({"messages": [{"role": "user"}]}, "message without a string 'content'"),
    ({"messages": [{"role": "user", "content": 7}]}, "message without a string 'content'"),
    ({"messages": [{"role": "user", "content": "only a question"}]}, "no tokens to train on"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "rejected by the chat template"),
    ({"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "content": "long answer " * 40}]}, "longer than seq_len"),
]


@pytest.mark.parametrize("case", range(len(BAD)), ids=[problem for _, problem in BAD])
def test_bad_record_stops_with_one_readable_line(case, tmp_path, tokenizer_dir, capsys):
    record, problem = BAD[case]
    source = _write_jsonl(tmp_path / "chat.jsonl", [GOOD, GOOD, record, GOOD])
    argv = [f"data.source={source}", "data.format=chat", f"data.tokenizer={tokenizer_dir}",
            "data.bad_records=stop", "data.val_fraction=0", "model.seq_len=64",
            f"run.dir={tmp_path / 'run'}", "run.progress=false"]
    assert train_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("zeroflow.train: error: bad record at chat.jsonl line 3: " + problem)
    assert "data.bad_records=skip" in err[0]


def test_bad_records_skipped_are_counted_by_kind(tmp_path, tokenizer_dir):
    records = [GOOD] * 5 + [record for record, _ in BAD] + [GOOD]
    source = _write_jsonl(tmp_path / "chat.jsonl", records)
    cfg = DataConfig(source=str(source), format="chat", tokenizer=str(tokenizer_dir),
                     val_fraction=0)
    data = load_data(cfg, 64)
    assert (data.records, len(data.train), data.bad.total) == (len(records), 6, len(BAD))
    summary = data.summary()
    assert "\n" not in summary and f"skipped {len(BAD)} bad records" in summary
    assert "2 message without a string 'content' (first: chat.jsonl line 11: message 0)" in summary
    for _, problem in BAD:
        assert problem in summary


def _batches(iterator, n):
    return [next(iterator) for _ in range(n)]


def _examples(n=60, seed=0):
    rng = np.random.default_rng(seed)
    examples = []
    for i in range(n):
        length = int(rng.integers(3, 30))
        tokens = np.arange(length, dtype=np.int32) + 1000 * i  # token says example and place
        examples.append({"inputs": tokens, "targets": tokens + 1,
                         "weights": (np.arange(length) >= length // 2).astype(np.int32)})
    return examples


def test_packed_rows_keep_examples_whole_with_restarting_positions():
    examples = _examples()
    batch = next(iter(packed_batches(examples, seq_len=64, batch_size=4, seed=0,
                                     packing_bins=8)))
    assert {k: v.shape for k, v in batch.items()} == {
        k: (4, 64) for k in ("tokens", "targets", "loss_mask", "segment_ids", "positions")}
    for row in range(4):
        seg, pos, tok = batch["segment_ids"][row], batch["positions"][row], batch["tokens"][row]
        for s in set(seg[seg > 0].tolist()):
            at = np.flatnonzero(seg == s)
            assert np.array_equal(at, np.arange(at[0], at[0] + len(at)))  # contiguous
            assert np.array_equal(pos[at], np.arange(len(at)))  # positions restart at 0
            example = examples[int(tok[at[0]]) // 1000]
            assert np.array_equal(tok[at], example["inputs"])  # the whole example, in order
            assert np.array_equal(batch["targets"][row][at], example["targets"])
            assert np.array_equal(batch["loss_mask"][row][at], example["weights"])
        padding = seg == 0
        assert not batch["loss_mask"][row][padding].any()


def test_loader_is_deterministic_resumable_and_sharded():
    examples = _examples()
    make = lambda **kw: iter(packed_batches(examples, seq_len=64, batch_size=2, seed=3,  # noqa: E731
                                            packing_bins=8, **kw))
    uninterrupted = _batches(make(), 12)
    for a, b in zip(uninterrupted, _batches(make(), 12)):  # same seed, same batches
        assert all(np.array_equal(a[k], b[k]) for k in a)
    other_seed = next(iter(packed_batches(examples, seq_len=64, batch_size=2, seed=4,
                                          packing_bins=8)))
    assert not np.array_equal(other_seed["tokens"], uninterrupted[0]["tokens"])

    # Resume: a fresh loader set to the state saved after 5 batches yields batches 6, 7, ...
    first = make()
    _batches(first, 5)
    state = json.loads(json.dumps(first.get_state()))  # it is saved as JSON
    resumed = make()
    resumed.set_state(state)
    for want, got in zip(uninterrupted[5:], _batches(resumed, 7)):
        assert all(np.array_equal(want[k], got[k]) for k in want)

    # Two processes read disjoint halves of the examples, and together all of them.
    seen = []
    for index in range(2):
        batches = _batches(make(process_index=index, process_count=2), 12)
        ids = {int(t) // 1000 for b in batches for t, s in zip(b["tokens"].ravel(),
                                                               b["segment_ids"].ravel()) if s}
        seen.append(ids)
    assert not seen[0] & seen[1] and seen[0] | seen[1] == set(range(len(examples)))


def test_demo_data_packs_at_least_95_percent_real_tokens(tmp_path, tokenizer_dir):
    demo = load_script("make_sft_data")
    source = tmp_path / "qa.jsonl"
    assert demo.main(["--out", str(source)]) == 0
    records = [json.loads(line) for line in source.read_text().splitlines()]
    assert len(records) > 500
    assert all(m["role"] in ("user", "assistant") for r in records for m in r["messages"])
    cfg = DataConfig(source=str(source), format="chat", tokenizer=str(tokenizer_dir),
                     val_fraction=0.05)
    data = load_data(cfg, 512)  # configs/sft-llama.yaml's seq_len and packing_bins
    assert data.bad.total == 0 and len(data.val) > 0
    assert packing_efficiency(data.train, seq_len=512, packing_bins=cfg.packing_bins) >= 0.95
