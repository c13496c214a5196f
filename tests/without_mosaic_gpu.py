"""Run a zeroflow command as on a jax whose Pallas has no Mosaic GPU backend: an import hook makes
``jax.experimental.pallas.mosaic_gpu`` unimportable, then the command's ``main`` runs.

    python tests/without_mosaic_gpu.py train ARGS...     # zeroflow.train's CLI
    python tests/without_mosaic_gpu.py library           # the kernels called directly
"""
import importlib.abc
import sys

GONE = "jax.experimental.pallas.mosaic_gpu"


class _Removed(importlib.abc.MetaPathFinder):
    """Refuses the module as Python refuses a module that is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == GONE or name.startswith(GONE + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def library() -> int:
    """Each kernel called directly: one line, a ValueError, per call."""
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels  # the package imports; a kernel fails when it is used

    q = jnp.zeros((1, 16, 2, 64), jnp.bfloat16)
    calls = {
        "flash_attention": lambda: pallas_kernels.flash_attention(q, q, q),
        "block_sparse_matmul": lambda: pallas_kernels.block_sparse_matmul(
            jnp.zeros((64, 32)), jnp.zeros((1, 32, 32)), np.ones((1, 1), bool), 32, interpret=True
        ),
    }
    for name, call in calls.items():
        try:
            call()
        except ValueError as err:
            print(f"{name}: {err}")
        else:
            print(f"{name}: no error")
    return 0


def main(argv: list[str]) -> int:
    from zeroflow.cli.common import start_script

    start_script()  # as ``python -m zeroflow.train`` starts: quiet before jax
    sys.meta_path.insert(0, _Removed())
    sys.modules.pop(GONE, None)
    if argv[0] == "library":
        return library()
    from zeroflow.cli import train

    return train.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
