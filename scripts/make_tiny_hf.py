"""Create a tiny local Hugging Face Llama folder to fine-tune: no download, seconds on a CPU.

    python scripts/make_tiny_hf.py --out runs/tiny-llama-hf

Writes what a published checkpoint folder holds: ``config.json`` and ``model.safetensors``
(a randomly initialised ``LlamaForCausalLM`` built by transformers), ``tokenizer.json`` +
``tokenizer_config.json`` (a byte-level BPE trained here with the ``tokenizers`` library on
the Python standard library's source, with Llama-style begin/end-of-text tokens) and
``chat_template.jinja`` (a small chat template that marks the assistant's turns with
``{% generation %}``). Needs torch and transformers: ``pip install -e ".[hf]"``.
configs/finetune-llama.yaml fine-tunes it on text, configs/sft-llama.yaml on conversations.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
# Each turn is a role header line, the text and EOS. The assistant's text and EOS sit inside
# {% generation %} so training can be limited to them (data.train_on=completion). Only the
# tokenizer's two special tokens are used: the headers are plain text.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles must be system, user or assistant, got ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _stdlib_text(max_bytes: int) -> Iterator[str]:
    try:
        from zeroflow.data import iter_documents
    except ImportError:  # run from a checkout without `pip install -e .`
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from zeroflow.data import iter_documents
    for doc in iter_documents("stdlib", val_fraction=0.0, max_bytes=max_bytes):
        yield doc.text


def train_tokenizer(out: Path, vocab_size: int, max_bytes: int):
    """A lossless byte-level BPE with BOS added to every encoding, saved in ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_stdlib_text(max_bytes), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
        "model_max_length": 1 << 20}, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return tok


def make_tiny_llama(out: str | Path, *, vocab_size: int = 512, hidden: int = 64, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, mlp: int = 128, context: int = 256,
                    tie: bool = False, max_bytes: int = 2_000_000, seed: int = 0) -> Path:
    """Write the folder and return its path."""
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise SystemExit(f"make_tiny_hf.py needs torch and transformers ({e}): "
                         "pip install -e \".[hf]\"") from None

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(out, vocab_size, max_bytes)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=mlp,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=context, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=tie, bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS))
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/tiny-llama-hf", help="output folder")
    parser.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary (default 512)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--max-bytes", type=int, default=2_000_000,
                        help="standard-library bytes the tokenizer trains on (default 2000000)")
    args = parser.parse_args(argv)
    out = make_tiny_llama(args.out, vocab_size=args.vocab_size, hidden=args.hidden,
                          layers=args.layers, max_bytes=args.max_bytes)
    print(f"wrote a tiny Llama and its tokenizer to {out}; fine-tune with "
          f"python -m zeroflow.train --config configs/finetune-llama.yaml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
