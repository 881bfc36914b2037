#!/usr/bin/env python3
"""The spec as a PDF (`make docs` runs it after the site): docs/spec/dtm-spec.md rendered by
python-markdown to one HTML document, typeset by WeasyPrint (PyPI; it needs the system's
Pango, which Debian ships): a title page, a table of contents with page numbers, the
sections numbered as the spec numbers them, and every cross-reference of the spec (its
`#anchor` links, the contents' entries) a working link inside the PDF.

    python docs/tools/build_pdf.py [OUT.pdf]        # default: site/dtm-spec.pdf
"""

from __future__ import annotations

import pathlib
import re
import sys
import time

import markdown
from weasyprint import HTML

ROOT = pathlib.Path(__file__).resolve().parents[2]
SPEC = ROOT / "docs" / "spec" / "dtm-spec.md"

CSS = """
@page { size: A4; margin: 2cm 1.8cm; @bottom-center { content: counter(page); font-size: 8pt; color: #555 } }
@page :first { @bottom-center { content: none } }
body { font-family: "DejaVu Sans", sans-serif; font-size: 9pt; line-height: 1.35 }
h1 { font-size: 22pt; margin-top: 8cm; text-align: center }
h2 { font-size: 15pt; page-break-before: always; border-bottom: 1px solid #999 }
h3 { font-size: 12pt } h4 { font-size: 10pt }
pre { font-family: "DejaVu Sans Mono", monospace; font-size: 7.5pt; background: #f4f4f4; padding: 4pt;
      white-space: pre-wrap; word-wrap: break-word }
code { font-family: "DejaVu Sans Mono", monospace; font-size: 8pt }
table { border-collapse: collapse; font-size: 7.5pt; width: 100% }
td, th { border: 1px solid #bbb; padding: 2pt 3pt; vertical-align: top }
a { color: #14528a; text-decoration: none }
nav.toc { page-break-before: always }
nav.toc ul { list-style: none; padding-left: 1.2em }
nav.toc a::after { content: leader('.') target-counter(attr(href), page) }
"""


def render(text: str) -> str:
    """The whole document as HTML: the title page, the contents, the spec."""
    md = markdown.Markdown(extensions=["toc", "tables", "fenced_code", "attr_list"],
                           extension_configs={"toc": {"toc_depth": "2-3"}})
    text = re.sub(r"## Contents\n.*?(?=\n## 1\. )", "", text, flags=re.S)  # (the contents come from the headings)
    body = md.convert(text)
    title, _, body = body.partition("</h1>")
    return (f"<html><head><meta charset='utf-8'><style>{CSS}</style></head><body>{title}</h1>"
            f"<nav class='toc'><h2 id='contents'>Contents</h2>{md.toc}</nav>{body}</body></html>")


def main() -> int:
    out = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "site" / "dtm-spec.pdf"
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    HTML(string=render(SPEC.read_text(encoding="utf-8")), base_url=str(SPEC.parent)).write_pdf(out)
    print(f"{out} ({out.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
