# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Each creates .venv when it is missing and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-test

.PHONY: demo test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/ir_tour.py
	$(BIN)/dtm launch -n 4 --axes dp=2,tp=2 examples/train_char_gpt_dist.py

test: $(STAMP)
	$(BIN)/python -m pytest -x -p no:cacheprovider tests

bench: $(STAMP)
	$(BIN)/python benchmarks/ir_bench.py

clean:
	rm -rf $(VENV) build *.egg-info
