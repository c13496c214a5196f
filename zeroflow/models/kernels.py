"""The sibling ``pallas_kernels`` package, imported when a setting first needs a kernel."""

from __future__ import annotations


def pallas_kernel(attr: str, setting: str):
    """Lazily fetch a kernel from the sibling ``pallas_kernels`` package."""
    try:
        import pallas_kernels

        return getattr(pallas_kernels, attr)
    except (ImportError, AttributeError) as err:
        raise ImportError(
            f"model.{setting} needs pallas_kernels.{attr}, which could not be imported ({err}); "
            "install the pallas_kernels package or choose another setting"
        ) from err
