"""The runner for the language-agnostic IR conformance vectors in `conformance/ir/`.

    results = run_ir_vectors()          # default root: the repository's conformance/ir
    print(summary(results))             # one line per failing vector, then "N passed, M failed"

Layout (conformance/ir/README.md says the same for implementers in other languages):

- `valid/NAME.dtm`: a valid module, often deliberately not canonical. Parsed from its raw
  bytes and verified, it must print (`format`) exactly as `valid/NAME.expected`, hash to
  `manifest.json`'s `valid[NAME].hash`, and survive the canonical encoding: the expected text
  reparses to itself and the same hash, and `decode(encode(m))` equals `m`, verifies, and
  prints text that parses back to the same hash.
- `invalid/NAME.dtm`: an invalid module. Parsing its raw bytes and verifying must raise
  `IRError` with `manifest.json`'s `invalid[NAME]` code, line and col (1-based; columns count
  Unicode code points, a tab is one column).
- `manifest.json`'s `unreachable`: error codes no small text file can reach, with the reason.

Every vector file must have a manifest entry and every entry a file, so a vector cannot be
skipped silently. Nothing here is a pytest test: `tests/test_conformance.py` and
`dtm conformance ir` both call `run_ir_vectors`.
"""

from __future__ import annotations

import json
import pathlib
import re
from dataclasses import dataclass

from ..errors import ErrorCode
from .diagnostics import IRError
from .decoding import decode
from .encoding import encode
from .parser import parse
from .printer import format as format_module
from .verifier import verify
from .version import SPEC_VERSION

DEFAULT_ROOT = pathlib.Path(__file__).resolve().parents[2] / "conformance" / "ir"
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class VectorResult:
    name: str
    kind: str  # "valid", "invalid"; the protocol set adds "handshake" and "crc32c"
    ok: bool
    detail: str = ""


def _describe(err: BaseException) -> str:
    if isinstance(err, IRError):
        where = f"{err.line}:{err.col}" if err.line is not None else "no location"
        return f"{err.code.value} at {where}: {err.message}"
    return f"{type(err).__name__} (not IRError): {err}"


def load_manifest(root: pathlib.Path | None = None) -> dict:
    root = pathlib.Path(root) if root is not None else DEFAULT_ROOT
    with open(root / "manifest.json", encoding="utf-8") as f:
        return json.load(f)


def manifest_or_failure(root: pathlib.Path, this_version: bool = False) -> dict | VectorResult:
    """The manifest.json of the vector set under `root`, or the failed result a runner
    reports in place of every vector when it cannot be read (or, with `this_version`, when
    its `spec_version` is another major.minor than this implementation's)."""
    try:
        manifest = load_manifest(root)
    except (OSError, ValueError) as e:
        return VectorResult("manifest.json", "valid", False, f"cannot read {root / 'manifest.json'}: {e}")
    version = str(manifest.get("spec_version", "")) if isinstance(manifest, dict) else ""
    if this_version and version.split(".")[:2] != [str(n) for n in SPEC_VERSION[:2]]:
        return VectorResult("manifest.json", "valid", False, f"the vectors are for spec {version!r}; this "
                            f"implementation reads {'.'.join(map(str, SPEC_VERSION))}")
    return manifest


def generator_main(argv: list[str] | None, description: str, files: dict[pathlib.Path, str], source: str,
                   written: str) -> int:
    """A vector generator's command line: write `files` ({path: content}, making their
    directories) and print `written`; with `--check`, write nothing, print each file that
    differs from what is on disk (as differing from what `source` gives) and return 1 if any
    does."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--check", action="store_true", help="compare with the files; write nothing")
    if ap.parse_args(argv).check:
        drift = [p.name for p, text in files.items() if not p.exists() or p.read_text(encoding="utf-8") != text]
        for name in drift:
            print(f"differs from what {source} give(s): {name}")
        return 1 if drift else 0
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    print(written)
    return 0


def check_valid(path: pathlib.Path, expected_path: pathlib.Path, want_hash: str | None) -> str | None:
    """None when the valid vector at `path` passes every rule, else what went wrong."""
    step = "parse"
    try:
        m = parse(path.read_bytes())
        step = "verify"
        verify(m)
        step = "format"
        text = format_module(m)
        if not expected_path.exists():
            return f"{expected_path.name} is missing"
        expected_bytes = expected_path.read_bytes()
        if text.encode("utf-8") != expected_bytes:
            return f"canonical text differs from {expected_path.name}: {_first_difference(text, expected_bytes)}"
        step = "hash"
        h = m.hash()
        if not isinstance(want_hash, str) or not _HEX64.fullmatch(want_hash):
            return f"manifest hash is not 64 lowercase hex digits: {want_hash!r}"
        if h != want_hash:
            return f"hash {h} != manifest {want_hash}"
        step = "reparse expected"
        m2 = verify(parse(expected_bytes))
        if format_module(m2) != text:
            return "format(parse(expected)) != expected"
        if m2.hash() != h:
            return f"the expected text hashes to {m2.hash()}, the vector to {h}"
        step = "encode/decode"
        d = decode(encode(m))
        if d != m:
            return "decode(encode(m)) != m"
        step = "verify decoded"
        verify(d)
        step = "reparse decoded"
        if verify(parse(format_module(d))).hash() != h:
            return "format(decode(encode(m))) parses to a different hash"
    except Exception as e:  # noqa: BLE001 - a runner reports every failure as a result
        return f"{step} failed: {_describe(e)}"
    return None


def check_invalid(path: pathlib.Path, want: dict) -> str | None:
    """None when parsing and verifying the vector at `path` fails exactly as `want` says."""
    code, line, col = want.get("code"), want.get("line"), want.get("col")
    if code not in {c.value for c in ErrorCode}:
        return f"manifest code {code!r} is not an ErrorCode"
    if not isinstance(line, int) or not isinstance(col, int):
        return f"manifest line/col must be integers, found {line!r}:{col!r}"
    try:
        verify(parse(path.read_bytes()))
    except IRError as e:
        got = (e.code.value, e.line, e.col)
        if got != (code, line, col):
            return f"want {code} at {line}:{col}, got {_describe(e)}"
        return None
    except Exception as e:  # noqa: BLE001
        return f"want {code} at {line}:{col}, got {_describe(e)}"
    return f"want {code} at {line}:{col}, but the module parsed and verified"


def _first_difference(text: str, expected: bytes) -> str:
    try:
        exp = expected.decode("utf-8")
    except UnicodeDecodeError:
        return "the expected file is not UTF-8"
    got_lines, exp_lines = text.split("\n"), exp.split("\n")
    for i, (g, x) in enumerate(zip(got_lines, exp_lines), 1):
        if g != x:
            return f"line {i}: got {g!r}, expected {x!r}"
    return f"got {len(got_lines)} lines, expected {len(exp_lines)}"


def run_ir_vectors(root: pathlib.Path | None = None) -> list[VectorResult]:
    """Run every vector under `root` (default: the repository's conformance/ir); one result
    per vector, valid ones first, each sorted by name."""
    root = pathlib.Path(root) if root is not None else DEFAULT_ROOT
    try:
        manifest = load_manifest(root)
    except (OSError, ValueError) as e:
        return [VectorResult("manifest.json", "valid", False, f"cannot read the manifest: {e}")]
    results: list[VectorResult] = []
    for kind in ("valid", "invalid"):
        entries = manifest.get(kind, {})
        files = {p.stem: p for p in (root / kind).glob("*.dtm")}
        for name in sorted(set(entries) | set(files)):
            path = files.get(name)
            if path is None:
                results.append(VectorResult(name, kind, False, f"in the manifest, but {kind}/{name}.dtm is missing"))
                continue
            if name not in entries:
                results.append(VectorResult(name, kind, False, f"{kind}/{name}.dtm has no manifest entry"))
                continue
            if kind == "valid":
                problem = check_valid(path, path.with_suffix(".expected"), entries[name].get("hash"))
            else:
                problem = check_invalid(path, entries[name])
            results.append(VectorResult(name, kind, problem is None, problem or ""))
    return results


def summary(results: list[VectorResult]) -> str:
    """One line per failing vector, then "N passed, M failed"."""
    failed = [r for r in results if not r.ok]
    lines = [f"FAIL {r.kind}/{r.name}: {r.detail}" for r in failed]
    lines.append(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return "\n".join(lines)


__all__ = ["VectorResult", "run_ir_vectors", "summary", "load_manifest", "check_valid", "check_invalid",
           "DEFAULT_ROOT"]
