"""Storage benchmark and DLIO-compatible workload emulator (``lcache bench``).

Reads DLIO workload YAML (``load_workload``), generates the dataset, reads it with the
configured reader threads while sleeping ``computation_time`` per step in place of the
accelerator, writes and reads per-rank checkpoints, and reports DLIO's metrics (AU,
samples/s, MB/s, checkpoint durations) in ``summary.json``. See ``docs/bench.md``.

Example:
    >>> from lcache.bench import parse_workload
    >>> w = parse_workload({"dataset": {"record_length_bytes": 4096}})
    >>> w.record_length
    4096
"""

from lcache.bench.config import (
    Workload,
    load_workload,
    parse_workload,
    resolve_config,
    shipped_configs,
)
from lcache.bench.run import BenchOptions, run_workload
from lcache.bench.traffic import StepIO

__all__ = [
    "BenchOptions",
    "StepIO",
    "Workload",
    "load_workload",
    "parse_workload",
    "resolve_config",
    "run_workload",
    "shipped_configs",
]
