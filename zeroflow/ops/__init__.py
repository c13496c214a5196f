"""Computations written in plain JAX that any model's code can call and that know nothing of
training state: ``chunked_cross_entropy``, a language-model loss that never holds the
``[tokens, vocab]`` logits."""

from zeroflow.ops.cross_entropy import chunked_cross_entropy, chunked_token_losses

__all__ = ["chunked_cross_entropy", "chunked_token_losses"]
