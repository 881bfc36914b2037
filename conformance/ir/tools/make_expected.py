#!/usr/bin/env python3
"""Regenerate what the implementation decides in the IR conformance vectors:

- valid/NAME.expected: the canonical text, `dtm.ir.format(parse(NAME.dtm))`;
- manifest.json "valid": {NAME: {"hash": Module.hash()}} for every valid/NAME.dtm;
- manifest.json "spec_version": dtm.ir.SPEC_VERSION.

The "invalid" entries (code, line, col) are hand-written expectations of where a careful
reader points: this script only checks them against the implementation and reports every
disagreement; it never writes them. "unreachable" is left as it is.

Run it when the spec version changes or a valid vector is added or edited, then review
`git diff conformance/ir` before committing: every changed .expected file or hash is a change
of the canonical form or the encoding, which other implementations must follow.

    .venv/bin/python conformance/ir/tools/make_expected.py          # write
    .venv/bin/python conformance/ir/tools/make_expected.py --check  # only compare; exit 1 on drift

Exit status: 0 when everything is (now) consistent, 1 when something needs a person.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]  # conformance/ir
sys.path.insert(0, str(ROOT.parents[1]))  # the repository, so `dtm` imports without installing

from dtm.ir import SPEC_VERSION, format, parse, verify  # noqa: E402
from dtm.ir.conformance import check_invalid  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if anything would change")
    ap.add_argument("--root", type=pathlib.Path, default=ROOT, help="the conformance/ir folder")
    args = ap.parse_args(argv)
    root: pathlib.Path = args.root
    manifest_path = root / "manifest.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8")) if manifest_path.exists() else {}
    problems: list[str] = []
    drift: list[str] = []

    valid: dict[str, dict] = {}
    for path in sorted((root / "valid").glob("*.dtm")):
        name = path.stem
        try:
            m = verify(parse(path.read_bytes()))
            text = format(m)
            h = m.hash()
        except Exception as e:  # noqa: BLE001 - report and carry on with the rest
            problems.append(f"valid/{name}: does not parse and verify: {e}")
            continue
        expected = path.with_suffix(".expected")
        if not expected.exists() or expected.read_bytes() != text.encode("utf-8"):
            drift.append(f"valid/{name}.expected")
            if not args.check:
                expected.write_bytes(text.encode("utf-8"))
        old = manifest.get("valid", {}).get(name, {}).get("hash")
        if old != h:
            drift.append(f"manifest valid/{name}: {old} -> {h}")
        valid[name] = {"hash": h}
    for name in sorted(set(manifest.get("valid", {})) - set(valid)):
        if not (root / "valid" / f"{name}.dtm").exists():
            drift.append(f"manifest valid/{name}: removed (no such file)")
    for stale in sorted((root / "valid").glob("*.expected")):
        if not stale.with_suffix(".dtm").exists():
            problems.append(f"{stale.relative_to(root)} has no .dtm beside it; delete it")

    invalid = manifest.get("invalid", {})
    for path in sorted((root / "invalid").glob("*.dtm")):
        if path.stem not in invalid:
            problems.append(f"invalid/{path.stem}: no manifest entry; write its code, line and col by hand")
    for name, want in sorted(invalid.items()):
        path = root / "invalid" / f"{name}.dtm"
        if not path.exists():
            problems.append(f"invalid/{name}: in the manifest, but the file is missing")
            continue
        why = check_invalid(path, want)
        if why:
            problems.append(f"invalid/{name}: {why}")

    spec = ".".join(map(str, SPEC_VERSION))
    if manifest.get("spec_version") != spec:
        drift.append(f"spec_version: {manifest.get('spec_version')} -> {spec}")
    new = {"spec_version": spec, "valid": valid, "invalid": invalid, "unreachable": manifest.get("unreachable", {})}
    if not args.check and new != manifest:
        manifest_path.write_text(json.dumps(new, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    for line in drift:
        print(("would update " if args.check else "updated ") + line)
    for line in problems:
        print("PROBLEM " + line)
    print(f"{len(valid)} valid, {len(invalid)} invalid vectors; {len(drift)} change(s), {len(problems)} problem(s)")
    return 1 if problems or (args.check and drift) else 0


if __name__ == "__main__":
    sys.exit(main())
