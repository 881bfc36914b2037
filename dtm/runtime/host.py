"""What this machine can give now: the free memory that bounds an allocation whose size
came from a user or a peer (a tensor's shape, a store put announced on the wire)."""

from __future__ import annotations

import os
import re

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


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# spec 9.4.13: decimal digits with an optional fraction, then an optional unit (any case), a
# trailing B or iB changing nothing; no sign, exponent, infinity or NaN
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(?:I?B)?\s*", re.IGNORECASE)


def parse_bytes(text: str, where: str) -> int:
    """A size as people write it: `2G`, `512M`, `1.5GiB`, `1000000` (K, M, G, T are powers
    of 1024; a fraction of a byte is dropped); E0306 naming `where` for anything else."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise user_error(ErrorCode.ATTRIBUTE_VALUE, f"{where}: a size such as 2G, 512M or 1000000 bytes, "
                         f"not {text!r}")
    whole, _, fraction = m.group(1).partition(".")
    unit = _UNITS[m.group(2).upper()]
    # exact arithmetic (no float): 0.1G is 107374182 bytes on every machine
    return (int(whole or "0") * unit) + (int(fraction or "0") * unit) // (10 ** len(fraction))


def _env_bytes(name: str) -> int | None:
    text = os.environ.get(name)
    return parse_bytes(text, name) if text else None


def memory_quota() -> int | None:
    """This process's memory quota in bytes ($DTM_MEMORY_QUOTA, set by `dtm launch
    --memory-quota` for its ranks), or None."""
    return _env_bytes("DTM_MEMORY_QUOTA")


def store_quota() -> int | None:
    """The bytes this rank's part of the mesh's store may hold ($DTM_STORE_QUOTA, set by
    `dtm launch --store-quota` for its ranks), or None."""
    return _env_bytes("DTM_STORE_QUOTA")


def resident_bytes() -> int:
    """The memory this process holds now (its resident set)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def check_free(nbytes: int, what: str) -> None:
    """Refuse an allocation of `nbytes` for `what` (a tensor's type, a program's memory)
    that is larger than the memory free, before it is made: E0810 at the user's line.
    Linux overcommits memory, so the allocation itself could succeed and the process be
    killed when its pages are touched; refusing here turns that into an error. Under a
    memory quota, one that would take the process past it is E0811."""
    quota = memory_quota()
    if quota is not None:
        in_use = resident_bytes()
        if in_use + nbytes > quota:
            raise user_error(ErrorCode.MEMORY_QUOTA_EXCEEDED, f"{what} needs {nbytes / 2**20:,.1f} MiB; with the "
                             f"{in_use / 2**20:,.1f} MiB this process holds, that passes its memory quota of "
                             f"{quota / 2**20:,.1f} MiB (DTM_MEMORY_QUOTA)")
    if nbytes <= SMALL_BYTES:
        return
    free = available_bytes()
    if free is not None and nbytes > free:
        raise user_error(ErrorCode.OUT_OF_MEMORY, f"{what} needs {nbytes / 2**30:.1f} GiB ({nbytes:,} bytes), "
                         f"more than the {free / 2**30:.1f} GiB of memory free")
