"""``load_record_data``: records -> tokenized train and validation examples, bad ones counted.

Every record is read and tokenized up front (the demo sets hold thousands of examples, read in
seconds); packing and batching then happen as the run asks for batches (``packing``). A record
is held out for validation when a hash of where it was found (file and line or record number)
falls below ``data.val_fraction``: the split depends on names only, as for text files.
"""

from __future__ import annotations

import collections
import dataclasses
import os

from zeroflow.config.schema import DataConfig
from zeroflow.data.corpus import held_out
from zeroflow.data.examples import BadRecord, TemplateFailed, example_encoder, training_pairs
from zeroflow.data.packing import fixed_batches, packed_batches, packing_efficiency
from zeroflow.data.records import iter_records
from zeroflow.data.tokenizers import Tokenizer, load_tokenizer


class BadRecords:
    """Counts records that cannot be used, or stops at the first (``data.bad_records``)."""

    def __init__(self, policy: str):
        self.policy = policy
        self.counts: collections.Counter[str] = collections.Counter()
        self.first: dict[str, str] = {}
        "The first example of each kind: where it was, and its detail."

    def add(self, where: str, problem: BadRecord | str) -> None:
        kind = problem.kind if isinstance(problem, BadRecord) else str(problem)
        if self.policy == "stop":
            raise ValueError(
                f"bad record at {where}: {problem} (data.bad_records=stop; "
                "data.bad_records=skip skips such records and counts them)"
            )
        self.counts[kind] += 1
        detail = getattr(problem, "detail", "")
        self.first.setdefault(kind, f"{where}: {detail}" if detail else where)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        """One line: how many were skipped, of which kinds, and where the first of each was."""
        if not self.total:
            return "no bad records"
        kinds = "; ".join(
            f"{n} {kind} (first: {self.first[kind]})" for kind, n in self.counts.most_common()
        )
        return f"skipped {self.total} bad records: {kinds}"


@dataclasses.dataclass(frozen=True, eq=False)
class RecordData:
    train: list[dict]
    "Training examples: inputs/targets/weights arrays (``examples.training_pairs``)."
    val: list[dict]
    tokenizer: Tokenizer
    tokens_per_byte: float
    "Tokens per UTF-8 byte of the rendered text, to report eval loss as bits per byte."
    source: str
    seq_len: int
    packing_bins: int
    records: int
    "Records read, bad ones included."
    bad: BadRecords

    packed = True
    "Batches are packed examples (dicts), not windows of one token stream."

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def trained_fraction(self) -> float:
        """Fraction of the training targets that the loss counts."""
        trained = sum(int(e["weights"].sum()) for e in self.train)
        return trained / max(sum(len(e["weights"]) for e in self.train), 1)

    def summary(self) -> str:
        efficiency = packing_efficiency(
            self.train, seq_len=self.seq_len, packing_bins=self.packing_bins
        )
        return (
            f"data {self.source}: {self.records:,} records, {len(self.train):,} train + "
            f"{len(self.val):,} val examples, {self.bad.summary()}; packed {efficiency:.1%} "
            f"of tokens real, {self.trained_fraction():.1%} of them trained on; "
            f"vocab {self.vocab_size}"
        )

    def train_batches(
        self, *, batch_size: int, seed: int, process_index: int = 0, process_count: int = 1
    ):
        """Grain ``IterDataset`` of this process's training batches (``batch_size`` rows)."""
        return packed_batches(
            self.train,
            seq_len=self.seq_len,
            batch_size=batch_size,
            seed=seed,
            packing_bins=self.packing_bins,
            process_index=process_index,
            process_count=process_count,
        )

    def eval_batches(
        self, *, num_batches: int, batch_size: int, process_index: int = 0, process_count: int = 1
    ) -> list[dict]:
        return fixed_batches(
            self.val,
            num_batches=num_batches,
            seq_len=self.seq_len,
            batch_size=batch_size,
            packing_bins=self.packing_bins,
            process_index=process_index,
            process_count=process_count,
        )


SFT_PACKAGES = ("grain", "datasets", "pyarrow", "jinja2")
"What the records pipeline imports (pyproject.toml's sft extra)."


def _check_installed() -> None:
    import importlib.util

    missing = [name for name in SFT_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(
            f"data.format=text/prompt_completion/chat needs {', '.join(missing)}: "
            "pip install 'zeroflow[sft]'"
        )


def load_record_data(cfg: DataConfig, seq_len: int) -> RecordData:
    """Read, check and tokenize every record of ``cfg.source`` (``cfg.format`` says how)."""
    _check_installed()
    tokenizer = load_tokenizer(cfg.tokenizer)
    encode = example_encoder(cfg, tokenizer, seq_len)
    bad = BadRecords(cfg.bad_records)
    splits: dict[str, list[dict]] = {"train": [], "val": []}
    tokens = num_bytes = records = 0
    for record in iter_records(cfg.source):
        records += 1
        if record.problem:
            bad.add(record.where, BadRecord(record.problem, record.detail))
            continue
        try:
            example = encode(record.value)
        except BadRecord as e:
            bad.add(record.where, e)
            continue
        except TemplateFailed as e:
            raise ValueError(
                f"{e} on the record at {record.where} (record {records - 1} of "
                f"{os.fspath(cfg.source)}); fix the template"
            ) from None
        tokens += len(example.tokens)
        num_bytes += example.num_bytes
        split = "val" if held_out(record.where, cfg.val_fraction) else "train"
        splits[split].append(training_pairs(example))
    source = os.fspath(cfg.source)
    if not splits["train"]:
        raise ValueError(
            f"{source}: no usable training records of {records} read "
            f"(data.format={cfg.format}): {bad.summary()}"
        )
    if cfg.val_fraction > 0 and not splits["val"]:
        raise ValueError(
            f"{source}: no validation records at data.val_fraction="
            f"{cfg.val_fraction} ({len(splits['train'])} usable); raise it, or "
            "set it to 0"
        )
    return RecordData(
        splits["train"],
        splits["val"],
        tokenizer,
        tokens / max(num_bytes, 1),
        source,
        seq_len,
        cfg.packing_bins,
        records,
        bad,
    )
