"""What the experiments write down about the machine that measured."""
from __future__ import annotations

import platform


def cpu_name() -> str:
    """The processor's model name (Linux's /proc/cpuinfo), else the machine type."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()
