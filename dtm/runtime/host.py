"""What this machine can give now: the free memory that bounds an allocation whose size
came from a user or a peer (a tensor's shape, a store put announced on the wire)."""

from __future__ import annotations

import os


def available_bytes() -> int | None:
    """The memory this machine can give now (Linux's MemAvailable, else all physical
    memory), or None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
