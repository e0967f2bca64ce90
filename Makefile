PY ?= python3

.PHONY: install demo test test-gpu test-all lint

# PYTHON tells scripts/install.sh which interpreter to install into: the one the targets run.
install:
	PYTHON="$(PY)" bash scripts/install.sh

demo: install
	$(PY) examples/quickstart.py

test: install
	$(PY) -m pytest -q -m "not slow and not gpu" tests

# GPU tests wherever they live: they carry the `gpu` marker, whatever their file is called.
test-gpu: install
	$(PY) -m pytest -q -m gpu tests

test-all: install
	$(PY) -m pytest -q tests

lint:
	$(PY) -m ruff check structgen structgen_server tests benchmarks examples
