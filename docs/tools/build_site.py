#!/usr/bin/env python3
"""Assemble the documentation site's sources (`make docs` runs it, then MkDocs, then the PDF).

MkDocs with the Material theme builds the site: the pages are markdown already (the spec,
the guides, the README), and Material gives the sidebar, client-side search and code
highlighting without a server; a Sphinx build would need the pages converted to MyST first.

What this script writes under build/site-src/ (the sources stay where they are):
- index.md: the README, its links into docs/ pointing at the site's pages;
- guide/*.md, architecture.md, benchmarks.md: the pages of docs/ (a ```python launch="..."
  or excerpt="..." fence, which tells tests/test_docs.py how to run or check the block, as ```python);
- spec/*.md: the spec split into its chapters, one page each (spec/index.md: the title and
  contents), each op's entry findable by its name's anchor (`spec/03-ops.md#neg`); a link
  from one chapter to another points at the other page;
- conformance/*.md: each vector directory's README;
- benchmarks/<name>.md: a page for each benchmark record of docs/benchmarks/ (written by a
  benchmark's --record, benchmarks/record.py): what it measures, its plot, the command, the
  machine and the date, the figures' JSON beside it; a link to a record's JSON or plot from
  another page points at that page;
- api/<module>.md: the API reference of each public module (API below), `::: dtm.nn` and its
  members: the names of the module's `__all__` (read from the imported module: dtm imports
  no torch), for `dtm` the functions and classes it imports by name; api/index.md lists the
  modules. mkdocstrings renders them from the docstrings, which griffe reads from the source
  (static analysis); docs/tools/griffe_runtime.py adds the names it cannot see there;
and build/mkdocs.yml (docs/mkdocs.base.yml with the repository's root and the API pages'
members put in), the nav listing all of them. A link to a file of the repository that
is not a page (a source file, a vector directory) becomes its text: the site has no such
file, and no link on it is broken.

    python docs/tools/build_site.py        # then: mkdocs build -f build/mkdocs.yml (strict; -q would hide its warnings)
    python docs/tools/build_site.py --out DIR --site DIR/site   # elsewhere (the tests: one per worker)
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import pathlib
import re
import shutil
import sys

from markdown.extensions.toc import slugify

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "build" / "site-src"  # (main's --out moves it)
SPEC = ROOT / "docs" / "spec" / "dtm-spec.md"
RECORDS = ROOT / "docs" / "benchmarks"  # the benchmarks' records: NAME.json and NAME.svg
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
# A guide's ```python launch="-n 4"``` or excerpt="FILE" block (how tests/test_docs.py runs or
# checks it): superfences takes no such option, so the site's copy is a plain ```python block.
TEST_ONLY = re.compile(r'^((?:```|~~~)[\w+-]+)[ \t]+(?:launch|excerpt)="[^"]*"[ \t]*$')
# The API reference's modules (tests/test_docstrings.py holds their public names to a docstring);
# a module before those that re-export its names (docs/tools/griffe_runtime.py's order).
API = ["dtm", "dtm.functional", "dtm.nn", "dtm.nn.functional", "dtm.optim", "dtm.parallel", "dtm.distributed",
       "dtm.store", "dtm.tasks", "dtm.data", "dtm.checkpoint", "dtm.elastic", "dtm.quant", "dtm.ir", "dtm.debug",
       "dtm.utils.data"]


def spec_chapters() -> tuple[str, list[tuple[str, str, str]]]:
    """The spec's text before chapter 1, and each chapter as (file name, title, text)."""
    lines = SPEC.read_text(encoding="utf-8").split("\n")
    starts = [i for i, line in enumerate(lines) if re.match(r"^## \d+\. ", line)]
    head = "\n".join(lines[:starts[0]])
    chapters = []
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(lines)
        number, title = re.match(r"^## (\d+)\. (.*)$", lines[start]).groups()
        name = f"{int(number):02d}-{slugify(title, '-')}.md"
        chapters.append((name, f"{number}. {title}", "\n".join(lines[start:end])))
    return head, chapters


def anchors(text: str) -> list[str]:
    """The anchors the site gives the headings of `text` (python-markdown's toc, as MkDocs)."""
    out, inside = [], False
    for line in text.split("\n"):
        if FENCE.match(line):
            inside = not inside
        elif not inside and (m := re.match(r"^#{1,6} (.*)$", line)):
            out.append(slugify(re.sub(r"`([^`]*)`", r"\1", m.group(1)), "-"))
    return out


def rewrite_links(text: str, source: pathlib.Path, page: str, pages: dict[pathlib.Path, str],
                  spec_anchor: dict[str, str]) -> str:
    """`text` (of repository file `source`, published as site page `page`) with each link
    pointing where the site has its target, outside code blocks only, and each ```python
    launch= or excerpt= fence a ```python one."""
    depth = page.count("/")

    def one(m: re.Match) -> str:
        bang, label, target = m.groups()
        if re.match(r"[a-z]+://|mailto:", target):
            return m.group(0)
        path, _, frag = target.partition("#")
        if not path:  # an anchor on the same page; in the spec, maybe on another chapter's page
            if source == SPEC and frag in spec_anchor and spec_anchor[frag] != page:
                return f"{bang}[{label}]({'../' * depth}{spec_anchor[frag]}#{frag})"
            return m.group(0)
        resolved = (source.parent / path).resolve()
        if resolved in pages:
            rel = "../" * depth + pages[resolved]
            return f"{bang}[{label}]({rel}{'#' + frag if frag else ''})"
        if bang and resolved.exists():  # an image: copied beside the pages
            (OUT / "assets").mkdir(parents=True, exist_ok=True)
            shutil.copy(resolved, OUT / "assets" / resolved.name)
            return f"{bang}[{label}]({'../' * depth}assets/{resolved.name})"
        return label  # a repository file that is not a page

    out, inside = [], False
    for line in text.split("\n"):
        if FENCE.match(line):
            inside = not inside
            line = TEST_ONLY.sub(r"\1", line)
        out.append(line if inside else LINK.sub(one, line))
    return "\n".join(out)


def api_members(name: str) -> list[str]:
    """The names the API page of module `name` lists, in their order: its `__all__` less its
    submodules (pages of their own, or internals); for `dtm`, whose `__all__` names little
    but its submodules, the functions and classes it imports by name (Tensor, jit, init,
    Mesh, ...), less dtm.functional's (`from .functional import *`: dtm.functional's page)."""
    module = importlib.import_module(name)  # (dtm imports no torch; under a second, once)
    if name != "dtm":
        return [n for n in module.__all__ if not inspect.ismodule(getattr(module, n))]
    functional = set(importlib.import_module("dtm.functional").__all__)
    return [n for n, obj in vars(module).items() if not n.startswith("_") and n not in functional
            and (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__.startswith("dtm.")]


def api_pages() -> dict[str, list[str]]:
    """Write api/<module>.md for each module of API and api/index.md; returns each module's
    members (for the nav, and for docs/tools/griffe_runtime.py)."""
    sys.path.insert(0, str(ROOT))  # (this checkout's dtm, the one griffe reads)
    (OUT / "api").mkdir(parents=True)
    rows, members = [], {}
    for name in API:
        module = importlib.import_module(name)
        first = re.split(r"(?<=\.)\s", " ".join((module.__doc__ or "").split()), maxsplit=1)[0]  # its first sentence
        rows.append(f"- [`{name}`]({name}.md): {first}")
        members[name] = api_members(name)
        options = f"    options:\n      members: {json.dumps(members[name])}\n"
        (OUT / "api" / f"{name}.md").write_text(f"::: {name}\n{options}", encoding="utf-8")
    (OUT / "api" / "index.md").write_text(
        "# API reference\n\nEach public module's functions and classes (the names of its `__all__`; for `dtm`, "
        "those it imports by name), from their docstrings. `dtm` also holds `dtm.functional`'s functions "
        "(`dtm.cat` is `dtm.functional.cat`), as do the Tensor's methods (`x.sum()` is "
        "`dtm.functional.sum(x)`).\n\n" + "\n".join(rows) + "\n",
        encoding="utf-8")
    return members


def benchmark_pages() -> list[str]:
    """Write benchmarks/<name>.md for each record in RECORDS, its plot and JSON beside it;
    returns the pages, by name."""
    (OUT / "benchmarks").mkdir(parents=True)
    pages = []
    for path in sorted(RECORDS.glob("*.json")):
        data, name = json.loads(path.read_text(encoding="utf-8")), path.stem  # (record.py names the file by it)
        m = data["machine"]
        for f in (path, path.with_suffix(".svg")):
            shutil.copy(f, OUT / "benchmarks" / f.name)
        features = ", ".join(m["features"]) or "none of those DTM looks for"
        (OUT / "benchmarks" / f"{name}.md").write_text(
            f"# {name}\n\n{data['about']}\n\n![{name}: {data['command']}]({name}.svg)\n\n"
            f"Measured on {data['date']} (commit `{data['commit'] or 'unknown'}`) by\n\n"
            f"```sh\n{data['command']}\n```\n\non {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; vector "
            f"features: {features}; {m['system']}, Python {m['python']}. The figures as the benchmark "
            f"recorded them: [{name}.json]({name}.json). The plot is drawn from them by the benchmark's own "
            f"`draw` (`python benchmarks/record.py` redraws every plot). Every benchmark's figures over "
            f"time: [Speed](../benchmarks.md).\n", encoding="utf-8")
        pages.append(f"benchmarks/{name}.md")
    return pages


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "build"), help="where site-src/ and mkdocs.yml go")
    ap.add_argument("--site", default=str(ROOT / "site"), help="where MkDocs writes the site")
    args = ap.parse_args()
    build = pathlib.Path(args.out).resolve()
    OUT = build / "site-src"
    if OUT.exists():
        shutil.rmtree(OUT)
    (OUT / "spec").mkdir(parents=True)
    head, chapters = spec_chapters()
    guides = sorted((ROOT / "docs" / "guide").glob("*.md"))
    vectors = sorted((ROOT / "conformance").glob("*/README.md"))
    pages: dict[pathlib.Path, str] = {(ROOT / "README.md").resolve(): "index.md",
                                      SPEC.resolve(): "spec/index.md",
                                      (ROOT / "docs" / "architecture.md").resolve(): "architecture.md",
                                      (ROOT / "docs" / "benchmarks.md").resolve(): "benchmarks.md"}
    pages.update({g.resolve(): f"guide/{g.name}" for g in guides})
    for record in RECORDS.glob("*.json"):  # a link to a record's figures or plot: its page
        pages[record.resolve()] = pages[record.with_suffix(".svg").resolve()] = f"benchmarks/{record.stem}.md"
    for v in vectors:  # the README, and a link to its directory, are the vectors' page
        pages[v.resolve()] = pages[v.parent.resolve()] = f"conformance/{v.parent.name}.md"
    spec_anchor = {a: "spec/index.md" for a in anchors(head)}
    for name, _, text in chapters:
        spec_anchor.update({a: f"spec/{name}" for a in anchors(text)})
    for name, _, text in chapters:
        (OUT / "spec" / name).write_text(rewrite_links(text, SPEC, f"spec/{name}", pages, spec_anchor) + "\n",
                                         encoding="utf-8")
    contents = "\n".join(f"- [{title}]({name})" for name, title, _ in chapters)
    index = re.sub(r"## Contents\n.*", f"## Contents\n\n{contents}\n", head, flags=re.S)
    (OUT / "spec" / "index.md").write_text(rewrite_links(index, SPEC, "spec/index.md", pages, spec_anchor),
                                           encoding="utf-8")
    for source, page in pages.items():
        if source == SPEC.resolve() or source.is_dir() or source.parent == RECORDS.resolve():
            continue
        target = OUT / page
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(rewrite_links(source.read_text(encoding="utf-8"), source, page, pages, spec_anchor),
                          encoding="utf-8")
    nav = ["nav:", "  - Home: index.md", "  - Guides:"]
    nav += [f"      - guide/{g.name}" for g in guides]
    nav += ["  - Architecture: architecture.md", "  - Spec:", "      - spec/index.md"]
    nav += [f"      - spec/{name}" for name, _, _ in chapters]
    nav += ["  - Conformance:"] + [f"      - conformance/{v.parent.name}.md" for v in vectors]
    nav += ["  - Benchmarks:", "      - benchmarks.md"] + [f"      - {p}" for p in benchmark_pages()]
    members = api_pages()
    nav += ["  - API reference:", "      - api/index.md"] + [f"      - {m}: api/{m}.md" for m in members]
    config = (ROOT / "docs" / "mkdocs.base.yml").read_text(encoding="utf-8").replace("{root}", str(ROOT))
    config = config.replace("{members}", json.dumps(members))
    config += f"site_dir: {pathlib.Path(args.site).resolve()}\n"
    (build / "mkdocs.yml").write_text(config + "\n" + "\n".join(nav) + "\n", encoding="utf-8")
    print(f"{len(pages)} pages, {len(chapters)} spec chapters and {len(members)} API pages in {OUT}")


if __name__ == "__main__":
    main()
