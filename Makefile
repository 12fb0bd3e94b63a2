# Two commands do all the set-up on a fresh machine:
#   make demo   - builds .venv, installs pagedcore, runs `pagedcore generate` on the built-in model
#   make test   - builds .venv, installs pagedcore with its test extras, runs ruff, mypy and the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch first: a plain `torch` requirement with no torch installed pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: install demo test lint typecheck unit bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[all]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/pagedcore generate

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/python .ci/typecheck.py

unit: install
	$(BIN)/pytest

test: lint typecheck unit

bench: install
	$(BIN)/pagedcore bench

clean:
	rm -rf $(VENV) build bench-out .pytest_cache .mypy_cache .ruff_cache
