"""A NumPy reference of delayed FP8 scaling, written from the recipe (not from zeroflow): per
tensor, the scale of this step is ``max(history) * 2**margin / 448`` (57344 for the e5m2
gradient), the previous scale (1 at first) while the history is empty; ``x / scale`` is
clipped and rounded with ml_dtypes; then the amax of the tensor cast enters a window of the
last ``history`` amaxes. Shared by test_fp8_delayed (the op, the library path) and
test_fp8_step (the train step)."""
import ml_dtypes
import numpy as np

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
TOPS = {E4M3: 448.0, E5M2: 57344.0}


class NpTensor:
    """One tensor's delayed scaling in NumPy: the previous scale and the window of amaxes."""

    def __init__(self, fmt, history, margin):
        self.fmt, self.length, self.margin = fmt, history, margin
        self.scale, self.window = 1.0, []

    def cast(self, x):
        """``(rounded values as float64, scale)`` of this step; records ``x``'s amax."""
        if self.window and max(self.window) > 0:
            self.scale = max(self.window) * 2.0**self.margin / TOPS[self.fmt]
        top = TOPS[self.fmt]
        q = np.clip(x.astype(np.float32) / np.float32(self.scale), -top, top).astype(self.fmt)
        self.window = (self.window + [float(np.max(np.abs(x)))])[-self.length:]
        return q.astype(np.float64), self.scale

    def padded_window(self):
        return sorted(self.window + [0.0] * (self.length - len(self.window)))


def check_meta(meta, ref: NpTensor, rtol=None):
    """Exact histories where the tensor cast is exactly the reference's; ``rtol`` where it is a
    computed bf16 activation (the GEMM's bf16 result, scaled, rounded again: an ulp or two)."""
    np.testing.assert_allclose(float(meta.scale), ref.scale, rtol=rtol or 1e-6)
    got, want = np.sort(np.asarray(meta.history)), ref.padded_window()
    if rtol is None:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=rtol)


def np_bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
