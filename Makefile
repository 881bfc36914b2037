# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Each creates .venv when it is missing and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-test
DEMO_STAMP := $(VENV)/.installed

DOCS_STAMP := $(VENV)/.installed-docs

.PHONY: demo test bench docs clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q -e '.[test,ray]'  # ray: tests/test_tasks_ray.py, tests/test_ray_launch.py
	touch $(STAMP)

# The demo needs the core install alone (not torch, transformers or Ray: a minute less set-up).
$(DEMO_STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q -e .
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/python examples/demo.py

# The op table (half the suite: every op on both backends, the `cpu` one compiling its C
# kernels) runs on two workers; the rest runs serially, since its process tests time waits.
# The serial phase prints its 25 slowest tests: the suite must stay under 15 minutes in CI.
# tests/test_site.py opens the docs site in Debian's chromium: installed here where apt can
# (as root); elsewhere that test says why it skips.
test: $(STAMP)
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		apt-get install -y -q chromium >/dev/null 2>&1; } || echo "chromium not installed: tests/test_site.py's browser checks will skip"
	$(BIN)/python -m pytest -x -p no:cacheprovider -n 2 tests/test_tensor_ops.py
	$(BIN)/python -m pytest -x -p no:cacheprovider --durations=25 --ignore=tests/test_tensor_ops.py tests

$(DOCS_STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

# The site in site/ (MkDocs with Material; the spec split into its chapters) and the spec's
# PDF, site/dtm-spec.pdf (WeasyPrint). Neither is committed.
docs: $(DOCS_STAMP)
	$(BIN)/python docs/tools/build_site.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build -q -f build/mkdocs.yml
	$(BIN)/python docs/tools/build_pdf.py

bench: $(STAMP)
	$(BIN)/python benchmarks/ir_bench.py

clean:
	rm -rf $(VENV) build site *.egg-info
