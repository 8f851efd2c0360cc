"""Child for the kill -9 test: generate a workload's dataset (and is killed while at it)."""

from __future__ import annotations

import sys

from lcache.bench import load_workload
from lcache.bench.datagen import generate

if __name__ == "__main__":
    cfg, data = sys.argv[1], sys.argv[2]
    w = load_workload(cfg)
    print("started", flush=True)
    generate(w, data)
    print("done", flush=True)
