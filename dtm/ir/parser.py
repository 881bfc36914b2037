"""Text to `Module`: the grammar of spec section "Text format".

The format is line-oriented: a header line `dtm MAJOR.MINOR`, then declarations (`mesh`,
`func`, `task`), one per line; a function's body holds one statement per line and ends
with `}` on its own line. `//` starts a comment.

Speed matters (the IR benchmark wants 100k ops/s for parse+verify), so a body line is split
by one regular expression into results, op name and operands, and the rest of the line
(attributes and result types) is parsed by the token parser once per distinct text and
memoised: real programs repeat the same `{axes = [1]} : f32[B, 768]` thousands of times.
Every other construct, and every error, goes through the token parser, which reports the
exact column.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..errors import ErrorCode as E
from .attrs import I64_MAX, I64_MIN, MAX_DIM, MAX_RANK, U64_MAX, normalize_attrs
from .diagnostics import IRError, TypeRuleError
from .dtypes import DTYPES
from .gcpause import gc_paused
from .module import AttrsKey, Func, Module, Op, Task, Value
from .registry import REGISTRY, TASK_ATTRS, AttrKind, AttrSpec
from .symbolic import Dim, dim_add, dim_mul, dim_neg, sym
from .typerules import check_quant_shape
from .types import REDUCE_OPS, Mesh, Placement, Sharding, TensorType
from .versioning import check_readable

MAX_TEXT_CHARS = 256 * 1024 * 1024
MAX_DEPTH = 128   # brackets and parentheses; a rank-64 literal inside its braces needs 66
MAX_NUMERAL = 40  # digits: every i64, u64, dim and f64 fits; longer is refused before int()

_TOKEN = re.compile(r"""
  (?P<ws>[ \t\r]+)
| (?P<comment>//.*)
| (?P<local>%[A-Za-z0-9_.]+)
| (?P<global>@[A-Za-z_][A-Za-z0-9_.]*)
| (?P<number>(?:[0-9]+\.[0-9]*|[0-9]+)(?:[eE][-+]?[0-9]+)?)
| (?P<string>"[^"\\]*+(?:\\.[^"\\]*+)*+")
| (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
| (?P<punct>->|[\[\](){}:,=*+\-])
""", re.X)
# The string's quantifiers are possessive: a backtracking `(?:[^"\\]|\\.)*` keeps state for
# every character (a 1 MB string cost 354 MB); these keep none and scan in linear time.

_NAME = r"%[A-Za-z0-9_.]+"
_STMT = re.compile(rf"[ \t]*(?:({_NAME}(?:[ \t]*,[ \t]*{_NAME})*)[ \t]*=[ \t]*)?([A-Za-z_][A-Za-z0-9_]*)"
                   rf"(?:[ \t]+({_NAME}(?:[ \t]*,[ \t]*{_NAME})*))?")
_HEADER = re.compile(r"[ \t]*dtm[ \t]+([0-9]{1,6})\.([0-9]{1,6})(?:\.([0-9]{1,6}))?[ \t]*(?://.*)?\r?$")


def tokenize(line: str, lineno: int, offset: int = 0) -> list[tuple[str, str, int]]:
    """(kind, text, col) for each token of one line; col is 1-based within the line."""
    out = []
    pos, end = 0, len(line)
    match = _TOKEN.match
    while pos < end:
        m = match(line, pos)
        if m is None:
            ch = line[pos]
            col = offset + pos + 1
            if ch == '"':
                raise IRError(E.UNTERMINATED_STRING, "string is not terminated on this line", lineno, col)
            raise IRError(E.INVALID_CHARACTER, f"unexpected character {ch!r}", lineno, col)
        kind = m.lastgroup
        if kind not in ("ws", "comment"):
            out.append((kind, m.group(), offset + pos + 1))
        pos = m.end()
    return out


class _Tokens:
    """A cursor over one line's tokens, with the recursive-descent pieces shared by
    declarations, attributes and types."""

    def __init__(self, line: str, lineno: int, offset: int = 0):
        self.toks = tokenize(line, lineno, offset)
        self.i = 0
        self.lineno = lineno
        self.end_col = offset + len(line.rstrip()) + 1
        self.depth = 0

    # -- basics --
    def peek(self) -> tuple[str, str, int] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def error(self, code: E, message: str, tok=None) -> IRError:
        tok = tok or self.peek()
        return IRError(code, message, self.lineno, tok[2] if tok else self.end_col)

    def unexpected(self, wanted: str) -> IRError:
        tok = self.peek()
        found = repr(tok[1]) if tok else "end of line"
        return self.error(E.UNEXPECTED_TOKEN, f"expected {wanted}, found {found}")

    def numeral(self, kind_wanted: str) -> tuple[str, str, int]:
        """A number token, refused when longer than any value the format holds."""
        tok = self.expect_kind("number", kind_wanted)
        if len(tok[1]) > MAX_NUMERAL:
            raise self.error(E.INVALID_NUMBER, f"number of {len(tok[1])} characters: longer than any value "
                             f"DTM IR holds ({MAX_NUMERAL})", tok)
        return tok

    def next(self):
        tok = self.peek()
        if tok is None:
            raise self.unexpected("more")
        self.i += 1
        return tok

    def accept(self, text: str) -> bool:
        tok = self.peek()
        if tok is not None and tok[1] == text and tok[0] in ("punct", "ident"):
            self.i += 1
            return True
        return False

    def expect(self, text: str) -> tuple[str, str, int]:
        tok = self.peek()
        if tok is None or tok[1] != text or tok[0] not in ("punct", "ident"):
            raise self.unexpected(repr(text))
        self.i += 1
        return tok

    def expect_kind(self, kind: str, wanted: str) -> tuple[str, str, int]:
        tok = self.peek()
        if tok is None or tok[0] != kind:
            raise self.unexpected(wanted)
        self.i += 1
        return tok

    def at_end(self) -> bool:
        return self.i >= len(self.toks)

    def expect_end(self) -> None:
        if not self.at_end():
            raise self.unexpected("end of line")

    def enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.error(E.NESTING_TOO_DEEP, f"nesting deeper than {MAX_DEPTH} levels")

    def leave(self) -> None:
        self.depth -= 1

    def comma_list(self, close: str, item) -> list:
        """item (',' item)* close, or just close."""
        out = []
        self.enter()
        if not self.accept(close):
            while True:
                out.append(item())
                if self.accept(close):
                    break
                if not self.accept(","):
                    raise self.unexpected(f"',' or {close!r}")
        self.leave()
        return out

    # -- numbers --
    def integer(self) -> int:
        neg = self.accept("-")
        tok = self.numeral("an integer")
        if not tok[1].isdigit():
            raise self.error(E.INVALID_NUMBER, f"expected an integer, found {tok[1]!r}", tok)
        v = -int(tok[1]) if neg else int(tok[1])
        if not I64_MIN <= v <= I64_MAX:
            raise self.error(E.INVALID_NUMBER, f"integer {tok[1]} does not fit in i64", tok)
        return v

    def scalar(self) -> int | float | bool:
        # Integers up to 2^64 - 1 are read here, so a u64 literal can hold every u64 value;
        # the element dtype bounds them afterwards.
        """A number (int if written without '.' or exponent), inf, nan, true or false."""
        tok = self.peek()
        if tok is not None and tok[0] == "ident" and tok[1] in ("true", "false"):
            self.i += 1
            return tok[1] == "true"
        neg = self.accept("-")
        tok = self.peek()
        if tok is not None and tok[0] == "ident" and tok[1] in ("inf", "nan"):
            self.i += 1
            v = float(tok[1])
            return -v if neg else v
        tok = self.numeral("a number")
        if tok[1].isdigit():
            v = int(tok[1])
            v = -v if neg else v
            if not I64_MIN <= v <= U64_MAX:
                raise self.error(E.INVALID_NUMBER, f"integer {tok[1]} does not fit in i64", tok)
            return v
        f = float(tok[1])
        return -f if neg else f

    # -- dims and types --
    def dim(self) -> Dim:
        """dim := ['-'] term (('+' | '-') term)*  (a leading '-' reads `-B + 5`, as printed)"""
        self.enter()
        at = self.peek()  # the dim's start, then the sign of the term being read
        try:
            d = dim_neg(self._term()) if self.accept("-") else self._term()
            while True:
                at = self.peek()
                if self.accept("+"):
                    d = dim_add(d, self._term())
                elif self.accept("-"):
                    d = dim_add(d, dim_neg(self._term()))
                else:
                    break
        except TypeRuleError as e:  # too complex: at the term that made it so
            raise self.error(e.code, e.message, at) from None
        self.leave()
        return d

    def _term(self) -> Dim:
        d = self._factor()
        while self.accept("*"):
            d = dim_mul(d, self._factor())
        return d

    def _factor(self) -> Dim:
        tok = self.peek()
        if tok is None:
            raise self.unexpected("a dim")
        if tok[0] == "number":
            if not tok[1].isdigit():
                raise self.error(E.INVALID_DIM, f"a dim must be an integer or a symbol, found {tok[1]!r}", tok)
            self.numeral("a dim")
            v = int(tok[1])
            if v >= MAX_DIM:
                raise self.error(E.INVALID_DIM, f"dim {tok[1]} is out of range [0, 2^62)", tok)
            return v
        if tok[0] == "ident":
            self.i += 1
            return sym(tok[1])
        if self.accept("("):
            d = self.dim()
            self.expect(")")
            return d
        raise self.unexpected("a dim")

    def tensor_type(self) -> TensorType:
        tok = self.expect_kind("ident", "a type such as f32[4]")
        dtype = DTYPES.get(tok[1])
        if dtype is None:
            raise self.error(E.UNKNOWN_DTYPE, f"unknown dtype {tok[1]!r} (known: {', '.join(DTYPES)})", tok)
        self.expect("[")
        dims = self.comma_list("]", self.dim)
        if len(dims) > MAX_RANK:
            raise self.error(E.INVALID_DIM, f"rank {len(dims)} exceeds the limit {MAX_RANK}", tok)
        for d in dims:
            if isinstance(d, int) and not 0 <= d < MAX_DIM:
                raise self.error(E.INVALID_DIM, f"dim {d} is outside [0, 2^62)", tok)
        t = TensorType(dtype, tuple(dims))
        try:
            check_quant_shape(t)
        except TypeRuleError as e:
            raise self.error(e.code, e.message, tok) from None
        return t

    def sharded_type(self) -> tuple[TensorType, Sharding | None]:
        t = self.tensor_type()
        tok = self.peek()
        if tok is not None and tok[0] == "global":
            return t, self.sharding()
        return t, None

    def sharding(self) -> Sharding:
        tok = self.expect_kind("global", "a mesh such as @m")
        self.expect("[")
        placements = self.comma_list("]", self.placement)
        return Sharding(tok[1][1:], tuple(placements))

    def placement(self) -> Placement:
        tok = self.expect_kind("ident", "replicate, shard(dim) or partial(op)")
        if tok[1] == "replicate":
            return Placement("replicate")
        if tok[1] == "shard":
            self.expect("(")
            d = self.integer()
            self.expect(")")
            return Placement("shard", d)
        if tok[1] == "partial":
            self.expect("(")
            op = self.expect_kind("ident", "a reduce op")
            if op[1] not in REDUCE_OPS:
                raise self.error(E.INVALID_PLACEMENT, f"partial({op[1]}): the op must be one of {', '.join(REDUCE_OPS)}", op)
            self.expect(")")
            return Placement("partial", op[1])
        raise self.error(E.INVALID_PLACEMENT, f"unknown placement {tok[1]!r}: expected replicate, shard(dim) or partial(op)", tok)

    # -- attributes --
    def string(self) -> str:
        tok = self.expect_kind("string", "a string")
        try:
            s = json.loads(tok[1])
            s.encode("utf-8")
            return s
        except (ValueError, UnicodeEncodeError):
            raise self.error(E.INVALID_STRING, f"invalid string {tok[1]}: strings use JSON escapes, hold no raw "
                             "control characters and no lone surrogates", tok) from None

    def nested(self) -> Any:
        """A literal: a scalar, or '[' nested (',' nested)* ']'."""
        if self.accept("["):
            return self.comma_list("]", self.nested)
        return self.scalar()

    def attr_value(self, spec: AttrSpec) -> Any:
        k = spec.kind
        tok = self.peek()
        if tok is None:
            raise self.unexpected(f"a value for {spec.name}")
        if k is AttrKind.INT:
            return self.integer()
        if k in (AttrKind.FLOAT, AttrKind.OPT_FLOAT, AttrKind.SCALAR):
            v = self.scalar()
            if k is not AttrKind.SCALAR and isinstance(v, bool):
                raise self.error(E.ATTRIBUTE_TYPE, f"attribute {spec.name} expects a number, found {v}", tok)
            return float(v) if k is not AttrKind.SCALAR else v
        if k is AttrKind.BOOL:
            if tok[0] == "ident" and tok[1] in ("true", "false"):
                self.i += 1
                return tok[1] == "true"
        elif k in (AttrKind.STRING, AttrKind.ENUM):
            if tok[0] == "string":
                return self.string()
        elif k is AttrKind.DTYPE:
            if tok[0] == "ident":
                self.i += 1
                if tok[1] not in DTYPES:
                    raise self.error(E.UNKNOWN_DTYPE, f"unknown dtype {tok[1]!r}", tok)
                return DTYPES[tok[1]]
        elif k in (AttrKind.MESH, AttrKind.FUNC):
            if tok[0] == "global":
                self.i += 1
                return tok[1][1:]
        elif k is AttrKind.LITERAL:
            return self.nested()
        elif k is AttrKind.DIM:
            return self.dim()
        elif tok[1] == "[":
            self.i += 1
            item = {AttrKind.INTS: self.integer, AttrKind.DIMS: self.dim, AttrKind.STRINGS: self.string,
                    AttrKind.REFS: lambda: self.expect_kind("global", "@name")[1][1:]}[k]
            return tuple(self.comma_list("]", item))
        raise self.error(E.ATTRIBUTE_TYPE, f"attribute {spec.name} expects {k.value}, found {tok[1]!r}", tok)

    def attr_dict(self, owner: str, specs: dict[str, AttrSpec]) -> tuple[dict[str, Any], dict[str, int]]:
        """'{' name '=' value (',' ...)* '}' -> raw values and each name's column."""
        given: dict[str, Any] = {}
        cols: dict[str, int] = {}

        def item():
            tok = self.expect_kind("ident", "an attribute name")
            spec = specs.get(tok[1])
            if spec is None:
                raise self.error(E.UNKNOWN_ATTRIBUTE, f"{owner} has no attribute {tok[1]!r} "
                                 f"(it has: {', '.join(specs) or 'none'})", tok)
            if tok[1] in given:
                raise self.error(E.UNEXPECTED_TOKEN, f"attribute {tok[1]!r} is given twice", tok)
            self.expect("=")
            given[tok[1]] = self.attr_value(spec)
            cols[tok[1]] = tok[2]

        self.expect("{")
        self.comma_list("}", item)
        return given, cols


def _normalize(toks: _Tokens, owner: str, specs: dict[str, AttrSpec], given: dict[str, Any],
               cols: dict[str, int], dtype, at: int) -> dict[str, Any]:
    try:
        return normalize_attrs(owner, specs, given, dtype)
    except TypeRuleError as e:
        raise IRError(e.code, e.message, toks.lineno, cols.get(e.attr, at)) from None


class _Parser:
    def __init__(self, text: str):
        self.lines = text.split("\n")
        self.module: Module | None = None
        self.tails: dict[tuple[str, str], tuple[dict, Any, list]] = {}

    def parse(self) -> Module:
        lines = self.lines
        n = len(lines)
        i = self._header()
        m = self.module
        while i < n:
            line = lines[i]
            stripped = line.strip()
            if not stripped or stripped.startswith("//"):
                i += 1
                continue
            word = stripped.split(None, 1)[0]
            if word == "func":
                i = self._func(i)
            elif word == "mesh":
                self._mesh(i)
                i += 1
            elif word == "task":
                self._task(i)
                i += 1
            else:
                toks = _Tokens(line, i + 1)
                raise toks.unexpected("'func', 'mesh' or 'task'")
        return m

    def _header(self) -> int:
        for i, line in enumerate(self.lines):
            stripped = line.strip()
            if not stripped or stripped.startswith("//"):
                continue
            m = _HEADER.match(line)
            if m is None:
                raise IRError(E.INVALID_HEADER, "the first line must be the header 'dtm MAJOR.MINOR', e.g. 'dtm 1.0'",
                              i + 1, len(line) - len(line.lstrip()) + 1)
            major, minor = int(m.group(1)), int(m.group(2))
            try:
                check_readable((major, minor))
            except IRError as e:
                raise IRError(e.code, e.message, i + 1, m.start(1) + 1) from None
            self.module = Module((major, minor))
            return i + 1
        raise IRError(E.INVALID_HEADER, "empty input: expected the header 'dtm MAJOR.MINOR'", 1, 1)

    def _declare(self, name: str, toks: _Tokens, tok) -> None:
        """Meshes, functions and tasks share one namespace of @names."""
        m = self.module
        if name in m.meshes or name in m.funcs or name in m.tasks:
            raise toks.error(E.DUPLICATE_SYMBOL, f"@{name} is already defined", tok)

    def _mesh(self, i: int) -> None:
        toks = _Tokens(self.lines[i], i + 1)
        toks.expect("mesh")
        tok = toks.expect_kind("global", "a mesh name such as @m")
        name = tok[1][1:]
        self._declare(name, toks, tok)
        toks.expect("[")

        def axis():
            a = toks.expect_kind("ident", "an axis name")
            toks.expect("=")
            size_tok = toks.peek()
            size = toks.integer()
            if not 1 <= size < MAX_DIM:
                raise toks.error(E.INVALID_MESH, f"axis {a[1]!r} has size {size}; sizes must be in [1, 2^62)", size_tok)
            return a, size

        axes = toks.comma_list("]", axis)
        toks.expect_end()
        seen = set()
        for a, _ in axes:
            if a[1] in seen:
                raise toks.error(E.INVALID_MESH, f"mesh @{name} repeats axis {a[1]!r}", a)
            seen.add(a[1])
        if not axes:
            raise toks.error(E.INVALID_MESH, f"mesh @{name} has no axes", tok)
        self.module.meshes[name] = Mesh(name, tuple((a[1], s) for a, s in axes))

    def _task(self, i: int) -> None:
        toks = _Tokens(self.lines[i], i + 1)
        toks.expect("task")
        tok = toks.expect_kind("global", "a task name such as @t")
        name = tok[1][1:]
        self._declare(name, toks, tok)
        toks.expect("=")
        func = toks.expect_kind("global", "the function to run, such as @f")[1][1:]
        given, cols = toks.attr_dict(f"task @{name}", TASK_ATTRS)
        toks.expect_end()
        attrs = _normalize(toks, f"task @{name}", TASK_ATTRS, given, cols, None, tok[2])
        self.module.tasks[name] = Task(name, func, attrs["inputs"], attrs["outputs"], attrs["after"], (i + 1, tok[2]))

    def _func(self, i: int) -> int:
        line = self.lines[i]
        toks = _Tokens(line, i + 1)
        toks.expect("func")
        tok = toks.expect_kind("global", "a function name such as @f")
        name = tok[1][1:]
        self._declare(name, toks, tok)
        scope: dict[str, Value] = {}
        toks.expect("(")

        def param():
            p = toks.expect_kind("local", "a parameter such as %x")
            if p[1] in scope:
                raise toks.error(E.REDEFINED_VALUE, f"{p[1]} is already defined", p)
            toks.expect(":")
            t, sh = toks.sharded_type()
            v = Value(t, p[1][1:], sh)
            scope[p[1]] = v
            return v

        params = toks.comma_list(")", param)
        toks.expect("->")
        toks.expect("(")
        result_types = toks.comma_list(")", toks.sharded_type)
        toks.expect("{")
        toks.expect_end()
        func = Func(name, params, result_types, loc=(i + 1, tok[2]))
        self.module.funcs[name] = func
        return self._body(func, scope, i + 1)

    def _body(self, func: Func, scope: dict[str, Value], i: int) -> int:
        lines, n = self.lines, len(self.lines)
        ops = func.ops
        stmt = _STMT.match
        tails = self.tails
        registry = REGISTRY
        lookup = scope.__getitem__
        while i < n:
            line = lines[i]
            lineno = i + 1
            i += 1
            m = stmt(line)
            if m is None:
                stripped = line.strip()
                if not stripped or stripped.startswith("//"):
                    continue
                if stripped == "}" or stripped.startswith("}"):
                    toks = _Tokens(line, lineno)
                    toks.expect("}")
                    toks.expect_end()
                    raise IRError(E.UNEXPECTED_TOKEN, f"function @{func.name} ends without a return", lineno,
                                  line.index("}") + 1)
                raise _Tokens(line, lineno).unexpected("a statement such as '%y = add %a, %b : f32[4]'")
            res_text, opname, opnd_text = m.groups()
            end = m.end()
            if opname == "return" and res_text is None:
                names = [nm.strip() for nm in opnd_text.split(",")] if opnd_text else []
                func.returns = [self._use(scope, nm, line, lineno, i, m.start(3)) for nm in names]
                func.return_loc = (lineno, m.start(2) + 1)
                _Tokens(line[end:], lineno, end).expect_end()
                return self._close(i)
            tail = line[end:]
            parsed = tails.get((opname, tail))
            if parsed is None:
                opdef = registry.get(opname)
                if opdef is None:
                    raise IRError(E.UNKNOWN_OP, f"unknown op {opname!r}", lineno, m.start(2) + 1)
                parsed = self._tail(opname, opdef, tail, lineno, end, m.start(2) + 1)
                tails[(opname, tail)] = parsed
            attrs, attrs_key, types = parsed
            try:  # names hold no blanks: drop them, split, look up (all in C)
                operands = tuple(map(lookup, opnd_text.replace(" ", "").replace("\t", "").split(","))) \
                    if opnd_text else ()
            except KeyError:
                operands = tuple([self._use(scope, nm.strip(), line, lineno, i, m.start(3))
                                  for nm in opnd_text.split(",")])
            if res_text is None:
                res_names = ()
            elif "," in res_text:
                res_names = [nm.strip() for nm in res_text.split(",")]
            else:
                res_names = (res_text,)
            if len(res_names) != len(types):
                raise IRError(E.RESULT_COUNT, f"{opname}: {len(res_names)} result name(s) but "
                              f"{len(types)} result type(s)", lineno, m.start(2) + 1)
            if len(res_names) == 1 and res_names[0] not in scope:  # the common case, short
                t, sh = types[0]
                v = scope[res_text] = Value(t, res_text[1:], sh)
                ops.append(Op(opname, operands, attrs, (v,), (lineno, m.start(2) + 1), attrs_key))
                continue
            results = []
            for k, (nm, (t, sh)) in enumerate(zip(res_names, types)):
                if nm in scope:
                    col = m.start(1)
                    for earlier in res_names[:k + 1]:  # find the k-th name, not an earlier equal one
                        col = _column_of(earlier, line, col)
                    raise IRError(E.REDEFINED_VALUE, f"{nm} is already defined", lineno, col)
                v = scope[nm] = Value(t, nm[1:], sh)
                results.append(v)
            ops.append(Op(opname, operands, attrs, tuple(results), (lineno, m.start(2) + 1), attrs_key))
        raise IRError(E.UNEXPECTED_TOKEN, f"function @{func.name} is not closed: expected 'return' and '}}'",
                      n, len(lines[-1]) + 1)

    def _close(self, i: int) -> int:
        lines, n = self.lines, len(self.lines)
        while i < n:
            stripped = lines[i].strip()
            i += 1
            if not stripped or stripped.startswith("//"):
                continue
            toks = _Tokens(lines[i - 1], i)
            toks.expect("}")
            toks.expect_end()
            return i
        raise IRError(E.UNEXPECTED_TOKEN, "expected '}' after return", n, len(lines[-1]) + 1)

    def _tail(self, opname: str, opdef, tail: str, lineno: int, offset: int, op_col: int):
        """attributes and result types after the operands: [attr-dict] [':' types]"""
        toks = _Tokens(tail, lineno, offset)
        given, cols = {}, {}
        tok = toks.peek()
        if tok is not None and tok[1] == "{":
            given, cols = toks.attr_dict(opname, opdef.attr_index)
        types = []
        if toks.accept(":"):
            types.append(toks.sharded_type())
            while toks.accept(","):
                types.append(toks.sharded_type())
        toks.expect_end()
        dtype = types[0][0].dtype if types else None
        attrs = _normalize(toks, opname, opdef.attr_index, given, cols, dtype, op_col)
        return attrs, AttrsKey(attrs), types

    def _use(self, scope: dict[str, Value], name: str, line: str, lineno: int, next_i: int, start: int) -> Value:
        v = scope.get(name)
        if v is not None:
            return v
        col = _column_of(name, line, start)
        if self._defined_later(name, next_i):
            raise IRError(E.USE_BEFORE_DEF, f"{name} is used before its definition", lineno, col)
        raise IRError(E.UNDEFINED_VALUE, f"{name} is not defined", lineno, col)

    def _defined_later(self, name: str, i: int) -> bool:
        pat = re.compile(rf"[ \t]*(?:{_NAME}[ \t]*,[ \t]*)*{re.escape(name)}[ \t]*[,=]")
        for line in self.lines[i:]:
            if line.strip() == "}":
                return False
            if pat.match(line):
                return True
        return False


def _column_of(name: str, line: str, start: int | None) -> int:
    """1-based column of the value name `name` as a whole token at or after `start`."""
    m = re.compile(rf"(?<![A-Za-z0-9_.%]){re.escape(name)}(?![A-Za-z0-9_.])").search(line, start or 0)
    return m.start() + 1 if m else 1


def parse(text: str | bytes) -> Module:
    """Parse DTM IR text into a Module. Raises IRError (and nothing else) on any bad input."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        if len(text) > MAX_TEXT_CHARS:
            raise IRError(E.INPUT_TOO_LARGE, f"input is {len(text)} bytes; the limit is {MAX_TEXT_CHARS}", 1, 1)
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            before = bytes(text)[: e.start]
            line = before.count(b"\n") + 1
            col = len(before[before.rfind(b"\n") + 1:].decode("utf-8", errors="replace")) + 1
            raise IRError(E.INVALID_UTF8, f"invalid UTF-8 at byte {e.start}", line, col) from None
    if not isinstance(text, str):
        raise IRError(E.INVALID_HEADER, f"parse() takes str or bytes, not {type(text).__name__}")
    if len(text) > MAX_TEXT_CHARS:
        raise IRError(E.INPUT_TOO_LARGE, f"input is {len(text)} characters; the limit is {MAX_TEXT_CHARS}", 1, 1)
    with gc_paused():
        return _Parser(text).parse()
