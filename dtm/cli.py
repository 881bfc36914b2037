"""The `dtm` command.

    dtm ir check FILE        parse and verify; errors as FILE:LINE:COL: CODE: message
    dtm ir fmt FILE          print the canonical text (--target 1.0 writes an older version)
    dtm ir hash FILE         print the module hash (hex sha256 of the canonical encoding)
    dtm ir ops               print the op registry
    dtm conformance ir       run the IR conformance vectors

FILE may be `-` for standard input. Every failure exits non-zero with the error on stderr.
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile

import click

from . import ir
from .ir.version import PACKAGE_VERSION, SPEC_VERSION


def _read(path: str) -> bytes:
    if path == "-":
        return sys.stdin.buffer.read()
    try:
        with open(path, "rb") as f:
            return f.read(ir.parser.MAX_TEXT_CHARS + 1)
    except OSError as e:
        raise click.ClickException(f"{path}: cannot read: {e.strerror}") from None


def _load(path: str, check: bool = True) -> ir.Module:
    """Parse (and verify) FILE; on IRError print it compiler-style and exit 1."""
    data = _read(path)
    try:
        module = ir.parse(data)
        return ir.verify(module) if check else module
    except ir.IRError as e:
        text = data.decode("utf-8", errors="replace")
        click.echo(ir.render(e, text, "<stdin>" if path == "-" else path), err=True)
        sys.exit(1)


def _version(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        major, minor = text.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        raise click.BadParameter(f"expected MAJOR.MINOR, e.g. 1.0, found {text!r}") from None


@click.group()
@click.version_option(PACKAGE_VERSION, message=f"dtm %(version)s (spec {'.'.join(map(str, SPEC_VERSION))})")
def main() -> None:
    """DTM, the Distributed Tensor Machine."""


@main.group("ir")
def ir_group() -> None:
    """Read, check, format and hash DTM IR (.dtm files)."""


@ir_group.command("check")
@click.argument("file")
def ir_check(file: str) -> None:
    """Parse and verify FILE."""
    m = _load(file)
    n_ops = sum(len(f.ops) for f in m.funcs.values())
    click.echo(f"{file}: ok: {len(m.funcs)} function(s), {n_ops} op(s), {len(m.meshes)} mesh(es), "
               f"{len(m.tasks)} task(s); hash {m.hash()}")


@ir_group.command("fmt")
@click.argument("file")
@click.option("--target", default=None, help="write for this older 1.x spec version, e.g. 1.0")
@click.option("--in-place", "-i", is_flag=True, help="rewrite FILE instead of printing")
def ir_fmt(file: str, target: str | None, in_place: bool) -> None:
    """Print FILE in canonical form."""
    m = _load(file)
    try:
        text = ir.format(m, target=_version(target))
    except ir.IRError as e:
        click.echo(ir.render(e, _read(file).decode("utf-8", "replace"), file), err=True)
        sys.exit(1)
    if in_place and file != "-":
        # Atomic: a crash leaves either the old file or the new one, never half of it.
        d = os.path.dirname(os.path.abspath(file))
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".dtm-fmt-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, file)
    else:
        click.echo(text, nl=False)


@ir_group.command("hash")
@click.argument("file")
def ir_hash(file: str) -> None:
    """Print the module hash of FILE."""
    click.echo(_load(file).hash())


@ir_group.command("ops")
def ir_ops() -> None:
    """Print the op registry."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"DTM IR ops (spec {'.'.join(map(str, SPEC_VERSION))})")
    for col in ("op", "category", "since", "operands", "attributes", "summary"):
        table.add_column(col)
    for d in ir.REGISTRY.values():
        attrs = ", ".join(f"{a.name}: {a.kind.value}" for a in d.attrs)
        table.add_row(d.name, d.category.value, f"{d.since[0]}.{d.since[1]}", ", ".join(d.operands), attrs, d.summary)
    Console().print(table)


@main.group("conformance")
def conformance_group() -> None:
    """Run the language-agnostic conformance vectors."""


@conformance_group.command("ir")
@click.option("--root", default=None, type=click.Path(exists=True, file_okay=False),
              help="vector directory (default: the repository's conformance/ir)")
def conformance_ir(root: str | None) -> None:
    """Run the IR vectors: valid modules against their canonical text and hash, invalid ones
    against their error code and line:col."""
    from .ir.conformance import run_ir_vectors

    results = run_ir_vectors(pathlib.Path(root) if root else None)
    failed = [r for r in results if not r.ok]
    for r in failed:
        click.echo(f"FAIL {r.kind} {r.name}: {r.detail}", err=True)
    click.echo(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    sys.exit(1 if failed or not results else 0)


if __name__ == "__main__":
    main()
