"""Hugging Face checkpoint -> zeroflow params, each leaf placed straight into its sharding.

Every leaf is built with ``jax.make_array_from_callback``: jax asks for the slice each device
holds under the leaf's sharding, and the callback reads just that slice from the
memory-mapped safetensors (one layer at a time for stacked block parameters), converts it to
the requested dtype on the host and hands it over. No device ever sees a whole tensor it does
not keep, and the host holds at most one leaf's slices at a time, so a model larger than one
device loads onto a mesh. bf16 -> fp32 is exact, so bf16 checkpoints load exactly.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroflow.config.schema import ModelConfig
from zeroflow.engine.plan import ZeroPlan
from zeroflow.hf.architectures import CONVERTERS, read_config
from zeroflow.hf.convert import Converter, HFConfig
from zeroflow.hf.quantized_load import place_quantized, quantized_abstract, quantizes
from zeroflow.hf.reader import HFCheckpointError, SafetensorsReader
from zeroflow.hf.tensors import TensorMap, read_region
from zeroflow.models.gpt import GPT, abstract_params
from zeroflow.util.tree import path_str

DTYPES = {
    "fp32": np.dtype(np.float32),
    "bf16": np.dtype(jnp.bfloat16),
    "fp16": np.dtype(np.float16),
}
_FLOAT_STORAGE = ("F32", "F16", "BF16", "F64")
_IGNORED = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|rotary_emb\.inv_freq)$")
"Buffers some exports carry that are not weights (GPT-2's causal mask, cached rope tables)."


def _dtype(dtype: str) -> np.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; choose one of {list(DTYPES)}")
    return DTYPES[dtype]


def _check_tensors(
    reader: SafetensorsReader,
    maps: list[TensorMap],
    num_layers: int,
    tied: bool,
    ignored: tuple[str, ...] = (),
) -> None:
    """Every tensor the table names exists with the shape config.json implies, is floating
    point, and nothing the table does not read is left over (a weight we would drop), but
    for the parts the converter leaves out on purpose (``ignored``: a vision tower)."""
    used = set()
    for m in maps:
        for layer in range(num_layers) if m.stacked else [None]:
            key = reader.resolve(m.key(layer))
            used.add(key)
            shape = reader.shape(key)
            if shape != m.hf_shape:
                raise HFCheckpointError(
                    f"{reader.file_of(key)}: {key} has shape {list(shape)}, but "
                    f"config.json implies {list(m.hf_shape)}"
                )
            if reader.dtype(key) not in _FLOAT_STORAGE:
                raise HFCheckpointError(
                    f"{reader.file_of(key)}: {key} is stored as "
                    f"{reader.dtype(key)}; expected a float type"
                )
    left = [
        k
        for k in reader.weight_map
        if k not in used
        and not _IGNORED.search(k)
        and not (tied and k.endswith("lm_head.weight"))
        and not k.startswith(ignored)
    ]
    if left:
        raise HFCheckpointError(
            f"{reader.file_of(left[0])}: {len(left)} tensors are not part of the "
            f"architecture config.json describes, e.g. {left[:3]}"
        )


def _place(
    m: TensorMap,
    shape: tuple[int, ...],
    sharding: jax.sharding.Sharding,
    dtype: np.dtype,
    read: Callable[[str, tuple], np.ndarray],
) -> jax.Array:
    """One leaf, each device's slice read on demand (slices shared by devices read once)."""
    slices: dict[tuple, np.ndarray] = {}

    def callback(index) -> np.ndarray:
        key = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        if key not in slices:
            slices[key] = read_region(m, shape, index, read).astype(dtype, copy=False)
        return slices[key]

    return jax.make_array_from_callback(shape, sharding, callback, dtype=dtype)


def _default_shardings(abstract) -> Any:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: one, abstract)


def load_params(
    path: str | os.PathLike,
    model_cfg: ModelConfig,
    *,
    converter: Converter | None = None,
    dtype: str = "fp32",
    shardings: Any = None,
    reader: SafetensorsReader | None = None,
    quantize: str | None = None,
) -> Any:
    """The params tree of ``model_cfg`` read from the checkpoint folder ``path``.

    ``converter``: the architecture's (default: the one config.json names). ``shardings``: a
    tree of ``jax.sharding.Sharding`` matching the params (e.g. a plan's
    ``storage_shardings``); default: everything on the first device. ``reader``: where the
    tensors come from (default: the folder's safetensors). ``quantize``: "nf4" or "int8" to
    read every matrix straight into a ``zf.QuantizedArray`` of that kind, tensor by tensor
    (``zeroflow.hf.quantized_load``), for a frozen base; ``shardings`` then matches that tree
    (``quantized_params_shape``), a ``QuantizedArray`` of the sharding of its bytes.
    """
    np_dtype = _dtype(dtype)
    converter = converter or CONVERTERS[read_config(path).architecture]
    reader = reader or SafetensorsReader(path, converter.key_prefixes)
    abstract = abstract_params(model_cfg)[0]
    maps = {m.ours: m for m in converter.tensor_maps(model_cfg)}
    paths = {path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(abstract)}
    if paths != set(maps):
        raise AssertionError(
            f"{converter.architecture} table and model disagree: {sorted(paths ^ set(maps))}"
        )
    _check_tensors(
        reader,
        list(maps.values()),
        model_cfg.num_layers,
        model_cfg.tie_embeddings,
        converter.ignored_prefixes,
    )
    if quantize is not None and shardings is None:
        shardings = _default_shardings(quantized_abstract(maps, abstract, np_dtype, quantize))
    shardings = _default_shardings(abstract) if shardings is None else shardings

    def one(p, leaf, sharding):
        m = maps[path_str(p)]
        if quantize is not None and quantizes(m, leaf.shape):
            return place_quantized(m, leaf.shape, sharding.data, np_dtype, quantize, reader.read)
        return _place(m, leaf.shape, sharding, np_dtype, reader.read)

    try:
        return jax.tree_util.tree_map_with_path(one, abstract, shardings)
    finally:
        reader.close()


def quantized_params_shape(model_cfg: ModelConfig, dtype: str, kind: str, architecture: str):
    """The abstract parameters ``load_params(..., quantize=kind)`` returns: each matrix a
    ``zf.QuantizedArray`` (of bytes shapes), each vector as it is."""
    maps = {m.ours: m for m in CONVERTERS[architecture].tensor_maps(model_cfg)}
    return quantized_abstract(maps, abstract_params(model_cfg)[0], _dtype(dtype), kind)


def from_pretrained(
    path: str | os.PathLike,
    dtype: str = "fp32",
    *,
    plan: ZeroPlan | None = None,
    shardings: Any = None,
    seq_len: int | None = None,
    quantize: str | None = None,
) -> tuple[GPT, Any, HFConfig]:
    """``(model, params, cfg)`` from a Hugging Face checkpoint folder (config.json + safetensors).

    ``model`` is zeroflow's Flax GPT configured as the checkpoint says
    (``model.apply({"params": params}, tokens)`` gives fp32 logits); ``params`` are in
    ``dtype`` ('fp32', 'bf16' or 'fp16'); ``cfg`` (an ``HFConfig``) is what
    ``save_pretrained`` needs to write the architecture back. Placement: ``plan`` puts each
    leaf in ``plan.storage_shardings`` (ZeRO / tensor-parallel), ``shardings`` gives a tree
    of them directly; default one device. ``seq_len`` sets ``cfg.model.seq_len`` (default:
    the checkpoint's context length).

    ``quantize``: "nf4" or "int8" reads a frozen base for QLoRA: every matrix becomes a
    ``zf.QuantizedArray``, quantized one tensor (one layer) at a time as it is read, so the
    model in ``dtype`` is never whole in host or device memory. Each layer is quantized on its
    own, as ``zf.quantize_frozen(..., stacked="layers")`` does. With ``plan`` the bytes are
    placed as the plan stores frozen weights (split over ``data`` at stage 3). The model reads
    them dequantized: ``zeroflow.engine.grads.dequantized.dequantized_on_use`` outside the
    train step, the step itself inside.
    """
    cfg = read_config(path)
    model_cfg = cfg.model if seq_len is None else dataclasses.replace(cfg.model, seq_len=seq_len)
    if shardings is None and plan is not None:
        shardings = (
            plan.storage_shardings(abstract_params(model_cfg)[0])
            if quantize is None
            else plan.compute_shardings(
                quantized_params_shape(model_cfg, dtype, quantize, cfg.architecture)
            )
        )
    params = load_params(
        path,
        model_cfg,
        converter=CONVERTERS[cfg.architecture],
        dtype=dtype,
        shardings=shardings,
        quantize=quantize,
    )
    return GPT(model_cfg), params, dataclasses.replace(cfg, model=model_cfg)
