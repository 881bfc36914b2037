"""The API reference's griffe extension (docs/tools/build_site.py names it in build/mkdocs.yml).

mkdocstrings reads DTM's source with griffe's static analysis, which sees each `def` and
`class` where it is written, but not what a module binds when it runs:
- a function a factory returns (`exp, log, ... = (_unary_float(o) for o in ...)` in
  dtm/functional.py), or that dtm/__init__.py binds with `globals().update(...)` (the views);
- another name for a function (`concat = cat`, dtm.store's `Info = Entry`);
- a function or class named as the submodule it comes from (`from .shard_map import
  shard_map`, `dtm.jit`, `dtm.tensor`): griffe gives the name to the submodule (its known
  limitation, mkdocstrings/griffe#124), and the page would show the module.
For each module of the reference this imports it (dtm imports no torch) and, for each name
its page lists that is a function or a class at run time but not as griffe has it, puts in
that name the function or class as the source defines it (`obj.__module__` and
`__qualname__`), or, made at run time, a function with the live one's docstring and
signature. Everything else stays as the source says.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import griffe


class RuntimeNames(griffe.Extension):
    """`members`: each module of the reference and the names its page lists."""

    def __init__(self, members: dict[str, list[str]]) -> None:
        super().__init__()
        self.members = members

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        # The aliases resolved first: a name put in below may hide a submodule that they go through.
        loader.resolve_aliases(implicit=False, external=False)
        collection = loader.modules_collection
        found = []
        for name, names in self.members.items():
            if name.split(".")[0] != pkg.name:
                continue
            live = importlib.import_module(name)
            static = collection[live.__name__]  # (dtm.checkpoint is dtm.ckpt)
            for member in names:
                obj = getattr(live, member, None)
                if (inspect.isfunction(obj) or inspect.isclass(obj)) and not _is(static, member, obj):
                    found.append((static, member, _defined(loader, static, obj, member)))
        for static, member, value in found:  # (after every look-up: a name put in may hide a submodule)
            static.set_member(member, value)


def _kind(obj: Any) -> griffe.Kind:
    return griffe.Kind.CLASS if inspect.isclass(obj) else griffe.Kind.FUNCTION


def _is(module: griffe.Module, name: str, obj: Any) -> bool:
    """Whether griffe has `name` in `module` as the kind of thing `obj` is."""
    try:
        return name in module.members and module.members[name].kind is _kind(obj)
    except griffe.AliasResolutionError:  # an alias of a name it has not
        return False


def _defined(loader: griffe.GriffeLoader, module: griffe.Module, obj: Any, name: str) -> griffe.Object | griffe.Alias:
    """`obj` as `module.name`: an alias of its definition where griffe has it, else a function
    with its docstring and signature (a class made at run time: an error, none is yet)."""
    try:
        target = loader.modules_collection[f"{obj.__module__}.{obj.__qualname__}"]
        if target.kind is _kind(obj):
            return griffe.Alias(name, target, parent=module)
    except (KeyError, griffe.AliasResolutionError):
        pass
    if inspect.isclass(obj):
        raise ValueError(f"the API reference: {obj.__module__}.{obj.__qualname__} is a class griffe does not see")
    parameters = []
    for p in inspect.signature(obj).parameters.values():
        default = None if p.default is inspect.Parameter.empty else repr(p.default)
        parameters.append(griffe.Parameter(p.name, kind=griffe.ParameterKind(p.kind.description), default=default))
    docstring = griffe.Docstring(inspect.cleandoc(obj.__doc__ or ""), parser=loader.docstring_parser,
                                 parser_options=loader.docstring_options)
    return griffe.Function(name, parameters=griffe.Parameters(*parameters), docstring=docstring, parent=module)
