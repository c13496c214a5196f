"""Moved to ``zeroflow.xla.hlo``: this path stays for code that imports it from here. Every
name read here, a private one too, is the one of ``zeroflow.xla.hlo``."""

from zeroflow.xla import hlo as _moved


def __getattr__(name: str):
    return getattr(_moved, name)
