"""`IRError`, the only exception the parser, verifier, encoder and decoder raise, and how
it is shown to a person: `FILE:LINE:COL: CODE: message`, the offending line, a caret."""

from __future__ import annotations

from ..errors import DTMError, ErrorCode


class IRError(DTMError):
    """An error in IR text, a module or its encoding. `line` and `col` are 1-based and None
    for modules built from Python or decoded from bytes (no source text)."""

    def __init__(self, code: ErrorCode, message: str, line: int | None = None, col: int | None = None):
        super().__init__(code, message)
        self.line = line
        self.col = col

    def __str__(self) -> str:
        where = f"{self.line}:{self.col}: " if self.line is not None else ""
        return f"{where}{self.code.value}: {self.message}"


class TypeRuleError(Exception):
    """A rule's verdict, before a location is known; `attr` names the attribute at fault,
    when one is. Callers turn it into an IRError at the statement's line and column."""

    def __init__(self, code: ErrorCode, message: str, attr: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.attr = attr


def render(err: IRError, text: str | None, filename: str = "<input>") -> str:
    """The error as a compiler prints it, with the source line and a caret under the column."""
    if err.line is None:
        return f"{filename}: {err.code.value}: {err.message}"
    out = f"{filename}:{err.line}:{err.col}: {err.code.value}: {err.message}"
    if text is not None:
        lines = text.split("\n")
        if 1 <= err.line <= len(lines):
            src = lines[err.line - 1].rstrip("\r")
            # Keep the source's tabs under the caret, so it lines up however tabs render.
            pad = "".join(c if c == "\t" else " " for c in src[:max(0, (err.col or 1) - 1)])
            out += f"\n  {src}\n  {pad}^"
    return out
