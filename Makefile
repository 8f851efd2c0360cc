# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench bench-cache clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build, pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,torch,report]'
	touch $@

demo: $(STAMP)
	$(BIN)/lcache demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q --durations=10

bench: $(STAMP)
	command -v fio >/dev/null || (apt-get update -qq && apt-get install -y -qq fio)
	$(BIN)/python benchmarks/store_bench.py --dir $${BENCH_DIR:-/var/tmp/lcache-bench} --json

# Sample cache vs mosaicml-streaming, litdata, fsspec filecache (peers in their own venv).
bench-cache: $(STAMP)
	$(BIN)/python benchmarks/cache_bench.py --json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
