"""What this machine can give now: the free memory that bounds an allocation whose size
came from a user or a peer (a tensor's shape, a store put announced on the wire)."""

from __future__ import annotations

import os

from ..errors import ErrorCode, user_error

# Below this many bytes memory is allocated without asking how much is free: reading
# /proc/meminfo costs more than most tensors' allocation, and a refusal of a small size by
# the system is numpy's MemoryError, which the executors report as E0810 too.
SMALL_BYTES = 1 << 30


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


def check_free(nbytes: int, what: str) -> None:
    """Refuse an allocation of `nbytes` for `what` (a tensor's type, a program's memory)
    that is larger than the memory free, before it is made: E0810 at the user's line.
    Linux overcommits memory, so the allocation itself could succeed and the process be
    killed when its pages are touched; refusing here turns that into an error."""
    if nbytes <= SMALL_BYTES:
        return
    free = available_bytes()
    if free is not None and nbytes > free:
        raise user_error(ErrorCode.OUT_OF_MEMORY, f"{what} needs {nbytes / 2**30:.1f} GiB ({nbytes:,} bytes), "
                         f"more than the {free / 2**30:.1f} GiB of memory free")
