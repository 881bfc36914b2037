"""Conformance levels and capability bits as a `Hello` carries them (spec 8.1, 8.2, 9.1.5).

Bit i of the Hello's `caps` field is the i-th capability of the table in spec 8.2; a level
implies the capabilities of it and every lower level, and a peer sets their bits.
"""

from __future__ import annotations

import enum


class Cap(enum.IntFlag):
    IR = 1 << 0
    EXEC = 1 << 1
    LOCAL_COLLECTIVES = 1 << 2
    MEMBERSHIP = 1 << 3
    WIRE_COLLECTIVES = 1 << 4
    P2P = 1 << 5
    STORE = 1 << 6
    TASKS = 1 << 7
    QUANT = 1 << 8
    CKPT = 1 << 9
    CANCEL = 1 << 10
    CHECKSUMS = 1 << 11
    QUOTAS = 1 << 12
    RESIZE = 1 << 13
    # Not implied by a level: the peer reads a Heartbeat's worker section (spec 9.1.5), an
    # addition to 1.0 that a peer reading 1.0 layouts would refuse as trailing bytes.
    WORKER_ROWS = 1 << 14


_NEW_AT_LEVEL = (
    Cap.IR | Cap.EXEC | Cap.LOCAL_COLLECTIVES,
    Cap.MEMBERSHIP | Cap.WIRE_COLLECTIVES | Cap.P2P,
    Cap.STORE | Cap.TASKS | Cap.QUANT,
    Cap.CKPT | Cap.CANCEL | Cap.CHECKSUMS | Cap.QUOTAS | Cap.RESIZE,
)
MAX_LEVEL = len(_NEW_AT_LEVEL) - 1


def level_caps(level: int) -> Cap:
    """Every capability level `level` (0 to 3) implies."""
    if not 0 <= level <= MAX_LEVEL:
        raise ValueError(f"levels are L0 to L{MAX_LEVEL}, found {level}")
    caps = Cap(0)
    for new in _NEW_AT_LEVEL[:level + 1]:
        caps |= new
    return caps


def cap_names(caps: int) -> list[str]:
    """The spec's names (`CAP_IR`, ...) of the known bits set in `caps`, in bit order."""
    return [f"CAP_{c.name}" for c in Cap if caps & c]
