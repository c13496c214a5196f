"""Deterministic token data: sources, tokenizers, token files and batches.

    data = load_data(cfg.data, cfg.model.seq_len)
    batch = train_batch(data.train, step, global_batch=..., seq_len=..., seed=cfg.train.seed)
"""
from zeroflow.data.batches import eval_batches, read_windows, train_batch
from zeroflow.data.corpus import (Document, SourceFile, held_out, iter_documents,
                                  list_source_files, split_files, stdlib_root)
from zeroflow.data.dataset import TokenData, bits_per_byte, encode_document, load_data
from zeroflow.data.token_files import TokenDirWriter, find_meta, read_token_dir
from zeroflow.data.tokenizers import (ByteTokenizer, HFTokenizer, SentencePieceTokenizer,
                                      Tokenizer, load_tokenizer, token_dtype,
                                      train_sentencepiece)

__all__ = [
    "ByteTokenizer", "Document", "HFTokenizer", "SentencePieceTokenizer", "SourceFile",
    "TokenData", "TokenDirWriter", "Tokenizer", "bits_per_byte", "encode_document", "eval_batches",
    "find_meta", "held_out", "iter_documents", "list_source_files", "load_data",
    "load_tokenizer", "read_token_dir", "read_windows", "split_files", "stdlib_root",
    "token_dtype", "train_batch", "train_sentencepiece",
]
