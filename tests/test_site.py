"""The documentation site and the spec's PDF (`make docs`), built as the make target builds
them and checked as a reader meets them: the site in headless Chromium (Playwright driving
Debian's `chromium`; `make test` installs it where apt can) served on 127.0.0.1, where search
finds `scaled_dot_product_attention` and `AdamW` and its result opens the op's or the class's
entry, pages render with their sidebar and highlighted code, and screenshots are saved; no
internal link of any page, the API reference's included, is broken (its page and its anchor
exist); the API reference has an entry for each public function and class of each module,
with its docstring; the PDF's pages render (pdfium) and its text holds every op's heading
and a contents with page numbers."""

from __future__ import annotations

import functools
import html as html_text
import http.server
import importlib
import inspect
import os
import pathlib
import posixpath
import re
import shutil
import subprocess
import sys
import threading

import pytest
from test_docstrings import MODULES  # this folder is on sys.path

from dtm.ir.registry import REGISTRY

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """`make docs`'s three steps, into a directory of this test process's own: the sources,
    MkDocs (strict: a warning, such as a broken link or anchor or a cross-reference in a
    docstring that resolves to nothing, fails the build; not `-q`, under which MkDocs drops
    the warnings before strict counts them), the PDF. Returns the site."""
    out = tmp_path_factory.mktemp("docs")
    site = out / "site"
    for cmd in ([sys.executable, "docs/tools/build_site.py", "--out", str(out), "--site", str(site)],
                [sys.executable, "-m", "mkdocs", "build", "-f", str(out / "mkdocs.yml")],
                [sys.executable, "docs/tools/build_pdf.py", str(site / "dtm-spec.pdf")]):
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                             env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))  # (Material's notice of its successor)
        assert done.returncode == 0, f"{' '.join(cmd)}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return site


def test_every_op_has_its_anchor_on_the_ops_page(built):
    html = (built / "spec" / "03-ops.html").read_text(encoding="utf-8")
    missing = [op for op in REGISTRY if f'id="{op}"' not in html]
    assert missing == []


def test_the_pdf_renders_and_holds_every_op_and_its_contents(built):
    import pypdf
    import pypdfium2

    pdf = built / "dtm-spec.pdf"
    reader = pypdf.PdfReader(pdf)
    assert len(reader.pages) > 100
    text = "\n".join(page.extract_text() for page in reader.pages)
    assert [op for op in REGISTRY if op not in text] == []
    contents = reader.pages[1].extract_text()
    assert "Contents" in contents and re.search(r"1\. Overview\s*\.*\s*\d+", contents)
    doc = pypdfium2.PdfDocument(str(pdf))
    for i in (0, len(doc) // 2, len(doc) - 1):  # the title, a page of ops, the last
        image = doc[i].render(scale=0.5).to_pil().convert("L")
        assert image.getextrema()[0] < 100, f"page {i + 1} rendered blank"


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # (no line per request on stderr)
        pass


@pytest.fixture(scope="module")
def browser(built, tmp_path_factory):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Chromium is not installed and could not be (make test runs apt-get install chromium as root)")
    from playwright.sync_api import sync_playwright

    handler = functools.partial(_Quiet, directory=str(built))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = b.new_page()
        page.set_default_timeout(30_000)
        yield page, f"http://127.0.0.1:{server.server_address[1]}/", tmp_path_factory.mktemp("screens")
        b.close()
    server.shutdown()


def _first_sentence(doc: str) -> str:
    """A docstring's first sentence, as its text reads in HTML (no markdown backticks)."""
    text = " ".join(inspect.cleandoc(doc).replace("`", "").split())
    return re.split(r"(?<=\.)\s", text, maxsplit=1)[0]


def _page_text(html: str) -> str:
    """The text of a built page: its tags and entities gone, its whitespace single spaces."""
    return " ".join(html_text.unescape(re.sub(r"<[^>]+>", "", html)).split())


@pytest.mark.parametrize("module, name", [("dtm", "Tensor"), ("dtm", "jit"), ("dtm.nn", "Linear"),
                                          ("dtm.optim", "AdamW")])
def test_the_api_reference_holds_a_name_and_its_docstring(built, module, name):
    html = (built / "api" / f"{module}.html").read_text(encoding="utf-8")
    assert f'id="{module}.{name}"' in html
    assert _first_sentence(getattr(importlib.import_module(module), name).__doc__) in _page_text(html)


def test_the_api_reference_has_every_public_function_and_class(built):
    """Each module tests/test_docstrings.py holds to a docstring has its page, and the page an
    entry for each function and class of its `__all__` (griffe's static analysis alone misses
    some: made at run time, or named as their submodule; docs/tools/griffe_runtime.py)."""
    index = (built / "api" / "index.html").read_text(encoding="utf-8")
    missing = []
    for module in MODULES:
        html = (built / "api" / f"{module}.html").read_text(encoding="utf-8")
        assert f'href="{module}.html"' in index
        live = importlib.import_module(module)
        missing += [f"{module}.{n}" for n in live.__all__ if (inspect.isfunction(obj := getattr(live, n))
                    or inspect.isclass(obj)) and f'id="{module}.{n}"' not in html]
    assert missing == []


@pytest.mark.parametrize("query, target", [
    ("scaled_dot_product_attention", "spec/03-ops.html#scaled_dot_product_attention"),
    ("AdamW", "api/dtm.optim.html#dtm.optim.AdamW"),
])
def test_search_finds_an_op_and_an_api_name(browser, query, target):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page, base, shots = browser
    path, anchor = target.split("#")
    page.goto(base + "index.html")
    page.locator("label.md-search__icon, .md-search__input").first.click()
    box = page.locator("input.md-search__input")
    box.fill(query)
    hit = page.locator(f".md-search-result a[href*='{path}'][href$='#{anchor}']").first
    try:
        hit.wait_for(timeout=15_000)
    except PlaywrightTimeout:  # typed before the search worker had its index (a loaded machine): once more
        box.fill("")
        box.fill(query)
        hit.wait_for()
    page.screenshot(path=shots / f"search-{query}.png")
    hit.click()
    page.wait_for_url(lambda url: path in url and url.endswith("#" + anchor))
    assert page.locator(f'[id="{anchor}"]').is_visible()


def test_no_internal_link_is_broken(built):
    """Every link of every page to another page of the site, and every anchor it names,
    exists (read from the built HTML: the browser test below renders some of them)."""
    pages = sorted(p.relative_to(built).as_posix() for p in built.rglob("*.html") if p.name != "404.html")
    assert len(pages) >= 20 and {"api/index.html", *(f"api/{m}.html" for m in MODULES)} <= set(pages)  # (checked too)
    html = {name: (built / name).read_text(encoding="utf-8") for name in pages}
    ids = {name: set(re.findall(r'\bid="([^"]+)"', text)) for name, text in html.items()}
    broken = []
    for name, text in html.items():
        for href in re.findall(r'<a [^>]*href="([^"]+)"', text):
            if re.match(r"[a-z]+:|//", href):
                continue
            path, _, frag = href.partition("#")
            target = posixpath.normpath(posixpath.join(posixpath.dirname(name), path.partition("?")[0])) if path \
                else name
            if not (built / target).exists():
                broken.append(f"{name}: {href}")
            elif frag and target in ids and frag not in ids[target]:
                broken.append(f"{name}: {href}")
    assert broken == []


def test_pages_render_in_the_browser_with_their_code_highlighted(browser):
    page, base, shots = browser
    for name in ("index.html", "spec/03-ops.html", "guide/tensors.html"):
        page.goto(base + name)
        assert page.locator("nav.md-nav").first.is_visible()  # the sidebar, drawn by Material
        page.screenshot(path=shots / (name.replace("/", "_") + ".png"))
    tokens = page.eval_on_selector_all(".highlight code span[class]", "els => els.length")
    assert tokens > 50  # guide/tensors.html's python blocks tokenised by Pygments: highlighted
