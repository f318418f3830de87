# Two commands do all the set-up on a fresh machine: `make train` and `make test`.
# Both create .venv and install the package (CPU torch 2.13.0 first) when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/fsdp2.yaml
TORCH_SPEC ?= torch==2.13.0

.PHONY: install train test lint bench matrix clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $@

install: $(VENV)/.installed

train: install
	$(PY) examples/train_llama.py fit --config $(CONFIG)

test: install
	$(VENV)/bin/ruff check src examples tests benchmarks
	$(PY) -m pytest tests -q -p no:cacheprovider --durations=15

lint: install
	$(VENV)/bin/ruff check src examples tests benchmarks

# The full real-models matrix (models x strategies x callbacks x precision, ~25 min on 2 cores);
# `make test` runs its representative cut.
matrix: install
	$(PY) tests/matrix/cells.py --full

bench: install
	$(PY) benchmarks/run.py all

clean:
	rm -rf $(VENV) lightning_logs checkpoints
