# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint system-deps bench bench-cache bench-ckpt bench-trace bench-dlio clean

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

# The tests need strace (lcache trace --syscalls), headless Chromium (the report opens in it)
# and openssl (a certificate for the HTTPS test).
system-deps:
	@command -v chromium >/dev/null && command -v strace >/dev/null && \
		command -v openssl >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq chromium strace openssl >/dev/null)

test: lint system-deps
	$(BIN)/python -m pytest -q -n 2 --durations=10

bench: $(STAMP)
	command -v fio >/dev/null || (apt-get update -qq && apt-get install -y -qq fio)
	$(BIN)/python benchmarks/store_bench.py --dir $${BENCH_DIR:-/var/tmp/lcache-bench} --json

# Sample cache vs mosaicml-streaming, litdata, fsspec filecache (peers in their own venv).
bench-cache: $(STAMP)
	$(BIN)/python benchmarks/cache_bench.py --json

# Checkpoints: lcache async_save vs torch.save vs DCP async_save, with fio's limits (root).
bench-ckpt: $(STAMP)
	command -v fio >/dev/null || (apt-get update -qq && apt-get install -y -qq fio)
	$(BIN)/python benchmarks/ckpt_bench.py --json

# What tracing costs: in-library events, /proc sampling, strace.
bench-trace: $(STAMP) system-deps
	$(BIN)/python benchmarks/trace_overhead.py --json

# lcache bench against DLIO 2.0.0 itself (DLIO and OpenMPI in their own venv).
bench-dlio: $(STAMP)
	$(BIN)/python benchmarks/dlio_compare.py --json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
