"""The compatibility promise (spec section "Versioning"), in code.

A reader implementing 1.N reads every 1.x module with x <= N and refuses a newer minor or
another major, naming both versions. A writer may target an older 1.x; it refuses, at the
producer, a module that uses an op added after the target, so an old reader never sees an
op it cannot know.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ErrorCode as E
from .diagnostics import IRError
from .registry import REGISTRY
from .version import SPEC_VERSION

if TYPE_CHECKING:  # module.py imports this file (through the encoder and printer)
    from .module import Module


def check_readable(version: tuple[int, int]) -> None:
    ours = SPEC_VERSION[:2]
    if version[0] != ours[0] or version[1] > ours[1]:
        raise IRError(E.UNSUPPORTED_VERSION, f"module is version {version[0]}.{version[1]}; this reader implements "
                      f"{ours[0]}.{ours[1]} and reads {ours[0]}.0 to {ours[0]}.{ours[1]}")


def lowest(module: Module) -> tuple[int, int]:
    """The lowest version whose ops express `module`: what a module built in code (no
    version of its own) is written as."""
    since = [REGISTRY[op.name].since for f in module.funcs.values() for op in f.ops if op.name in REGISTRY]
    return max([(SPEC_VERSION[0], 0), *since])


def check_target(module: Module, target: tuple[int, int] | None) -> tuple[int, int]:
    """The version to write `module` as (default: its own, else `lowest`); IRError when
    `target` cannot express it."""
    if target is None:
        target = module.version or lowest(module)
    target = tuple(target[:2])
    check_readable(target)
    for f in module.funcs.values():
        for op in f.ops:
            opdef = REGISTRY.get(op.name)
            if opdef is not None and opdef.since > target:
                raise IRError(E.OP_NEWER_THAN_TARGET,
                              f"@{f.name}: op {op.name} was added in {opdef.since[0]}.{opdef.since[1]}; "
                              f"target {target[0]}.{target[1]} cannot express it",
                              *(op.loc or (None, None)))
    return target
