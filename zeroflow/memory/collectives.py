"""Moved to ``zeroflow.xla.collectives``: this path stays for code that imports it from here. Every
name read here, a private one too, is the one of ``zeroflow.xla.collectives``."""

from zeroflow.xla import collectives as _moved


def __getattr__(name: str):
    return getattr(_moved, name)
