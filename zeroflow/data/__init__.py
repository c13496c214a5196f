"""Deterministic token data: sources, tokenizers, token files and batches.

    data = load_data(cfg.data, cfg.model.seq_len)
    batch = train_batch(data.train, step, global_batch=..., seq_len=..., seed=cfg.train.seed)

With a records ``data.format`` (text / prompt_completion / chat) ``load_data`` returns a
``RecordData`` whose ``train_batches(...)`` is a Grain pipeline of packed batches.
"""

from zeroflow.data.batches import eval_batches, read_windows, train_batch
from zeroflow.data.chat import ChatTemplate, load_chat_template
from zeroflow.data.corpus import (
    Document,
    SourceFile,
    held_out,
    iter_documents,
    list_source_files,
    split_files,
    stdlib_root,
)
from zeroflow.data.dataset import TokenData, bits_per_byte, encode_document, load_data
from zeroflow.data.examples import BadRecord, example_encoder
from zeroflow.data.packing import packed_batches
from zeroflow.data.record_data import BadRecords, RecordData, load_record_data
from zeroflow.data.records import iter_records
from zeroflow.data.token_files import TokenDirWriter, find_meta, read_token_dir
from zeroflow.data.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    load_tokenizer,
    token_dtype,
    train_sentencepiece,
)

__all__ = [
    "BadRecord",
    "BadRecords",
    "ChatTemplate",
    "RecordData",
    "example_encoder",
    "iter_records",
    "load_chat_template",
    "load_record_data",
    "packed_batches",
    "ByteTokenizer",
    "Document",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "SourceFile",
    "TokenData",
    "TokenDirWriter",
    "Tokenizer",
    "bits_per_byte",
    "encode_document",
    "eval_batches",
    "find_meta",
    "held_out",
    "iter_documents",
    "list_source_files",
    "load_data",
    "load_tokenizer",
    "read_token_dir",
    "read_windows",
    "split_files",
    "stdlib_root",
    "token_dtype",
    "train_batch",
    "train_sentencepiece",
]
