"""Logical axis names for model parameters: the one place they are spelled.

Layers tag every parameter dimension with one of these names; a short rules table elsewhere maps
them to mesh axes (e.g. HEADS, KV_HEADS, MLP, VOCAB -> "model"; everything else replicated or
ZeRO-sharded over "data").
"""

VOCAB = "vocab"
"Token vocabulary (embedding rows, logits columns)."
EMBED = "embed"
"Model width, the residual stream."
MLP = "mlp"
"MLP hidden width."
HEADS = "heads"
"Query heads (and the attention output projection's input heads)."
KV_HEADS = "kv_heads"
"Key/value heads (fewer than HEADS with grouped-query attention)."
HEAD_DIM = "head_dim"
"Per-head width."
LAYERS = "layers"
"The stacked decoder-block axis that nn.scan adds in front of every block parameter."
NORM = "norm"
"Norm scale and bias vectors."
POSITIONS = "positions"
"Rows of a learned position-embedding table."


def is_axis_names(x) -> bool:
    """Leaf test for logical-axes trees, whose leaves are tuples of names (tuples are pytrees)."""
    return isinstance(x, tuple) and all(isinstance(n, str) or n is None for n in x)
