# `make demo` and `make test` set up a local virtual environment on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: setup demo test speed clean

setup: $(STAMP)

# torch first, pinned: its CPU build lies on local disk; a bare `torch` would pull a CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/specdecode demo

test: $(STAMP)
	$(BIN)/python -m pytest -q --run-slow

speed: $(STAMP)
	$(BIN)/specdecode speed --target qwen2.5-coder-1.5b-instruct

clean:
	rm -rf $(VENV) build *.egg-info
