"""Moved to ``zeroflow.xla.schedule``: this path stays for code that imports it from here. Every
name read here, a private one too, is the one of ``zeroflow.xla.schedule``."""

from zeroflow.xla import schedule as _moved


def __getattr__(name: str):
    return getattr(_moved, name)
