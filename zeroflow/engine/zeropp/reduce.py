"""qgZ: the stage-3 gradient reduce-scatter with int8 values in transit and fp32 sums.

A gathered weight's gradient (whole, fp32, different on every device) must leave as this
device's 1/N slice of the sum over devices, which plain stage 3 does with one fp32
``psum_scatter``. Here (Wang et al. 2023, section 4.3), on H hosts of L devices:

1. the gradient is cut into N slices, one per destination device, and grouped by the
   destination's local index; each group is quantized (blockwise int8) and sent to the device
   of this host with that local index (an all-to-all within the host);
2. each device dequantizes what it received and sums it in fp32: the host's partial sums of
   the H slices whose destinations share its local index;
3. those are requantized, one per destination host, and sent across hosts (an all-to-all among
   the devices with this local index, one per host);
4. dequantized and summed in fp32 again: this device's slice, summed over all N devices.

int8 values are never added: every sum is over dequantized fp32 values. The bytes that cross
hosts are one int8 slice (plus scales) per peer host where plain stage 3 sends fp32: about a
quarter. Each slice is quantized on its own (blocks never straddle two destinations).

``zeroflow.engine.grads.sources.Stage3Collectives`` reduces this way when the plan sets
``quantize_grads``; a quantizing reduction is not the transpose of the gather, so a weight
fetched outside a unit differentiates through ``sources.gather_weight_vjp``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zeroflow.backend.mesh import zero_axes
from zeroflow.engine.hosts import HostSplit, index_groups
from zeroflow.engine.padding import pad_to
from zeroflow.engine.zeropp.quantize import dequantize, quantize


def _exchanged(rows, groups, block_size: int):
    """Inside shard_map: ``rows`` ([members, k] fp32, row i for group member i) quantized row by
    row, exchanged within ``groups`` (an all-to-all), dequantized and summed over the senders
    in fp32: ``[k]``."""
    q = jax.vmap(lambda r: quantize(r, block_size))(rows)
    listed = index_groups(groups)
    values = jax.lax.all_to_all(q.values, zero_axes(), 0, 0, axis_index_groups=listed)
    scales = jax.lax.all_to_all(q.scales, zero_axes(), 0, 0, axis_index_groups=listed)
    received = dequantize(q._replace(values=values, scales=scales), rows.shape[1:])
    return jnp.sum(received, axis=0)


def quantized_reduce_scatter(
    grad, dim: int, split: HostSplit, block_size: int, padded: int | None = None
):
    """This device's slice (along ``dim``) of the sum over devices of ``grad``, in fp32, as
    ``zeroflow.engine.grads.collectives.reduce_scatter`` returns it, moved as int8 blocks of
    ``block_size`` entries in two hops (within the host, then across hosts); with ``padded``,
    ``grad`` is first padded with zeros to that many entries along ``dim``."""
    grad = grad.astype(jnp.float32)
    if padded is not None:
        grad = pad_to(grad, dim, padded)
    hosts, local = split
    moved = jnp.moveaxis(grad, dim, 0)
    slice_shape = (moved.shape[0] // (hosts * local), *moved.shape[1:])
    # [destination host, destination local index, slice entries]
    slices = moved.reshape(hosts, local, -1)
    host_sums = _exchanged(jnp.swapaxes(slices, 0, 1), split.within, block_size)
    mine = _exchanged(host_sums.reshape(hosts, -1), split.across, block_size)
    return jnp.moveaxis(mine.reshape(slice_shape), 0, dim)
