"""DLIO workload YAML: parse, validate and resolve into one typed :class:`Workload`.

The sections and key names are those of the DLIO benchmark (argonne-lcf/dlio_benchmark,
``dlio_benchmark/utils/config.py`` and its ``configs/workload/*.yaml``), so a DLIO or MLPerf
Storage workload file runs here unchanged. Deliberate differences from DLIO:

* an unknown key is an error that names the key and the file (DLIO 2.0.0 silently drops it, so a
  typo such as ``train.epoch`` quietly runs the default epoch count);
* a key DLIO knows but this emulator does not implement (``storage_type: s3``, ``format: hdf5``)
  is refused rather than ignored;
* every number is checked against its range (``_RANGES``, wide enough for every published DLIO
  and MLPerf Storage workload) and the totals against theirs, and the YAML is plain
  (``yamlfile``: no tags, no aliases, bounded size and depth), so bad input is one
  ``ConfigError``, never a traceback, a hang or a runaway allocation (docs/bench.md).

DLIO versions spell the record size two ways: 2.0.0 reads ``dataset.record_length`` and ignores
``record_length_bytes``; newer DLIO reads the latter. Both are accepted (the same for ``_stdev``
and ``_resize``); giving both with different values is an error.
"""

from __future__ import annotations

import dataclasses
import math
import os
import reprlib
from dataclasses import dataclass, field
from typing import Any

from lcache.bench.yamlfile import load_yaml, read_file
from lcache.errors import ConfigError

# Formats whose I/O this emulator reproduces (DLIO FormatType values).
FORMATS = ("npz", "npy", "indexed_binary", "mmap_indexed_binary", "tfrecord")
_DLIO_ONLY_FORMATS = ("hdf5", "csv", "jpeg", "png", "parquet", "synthetic")

# section -> key -> kind ("v" a value, "d" a nested mapping checked by _NESTED).
_SCHEMA: dict[str, dict[str, str]] = {
    "model": {k: "v" for k in (
        "name", "type", "model_size", "model_size_bytes", "num_layers", "model_datatype",
        "optimizer_datatype", "layer_parameters", "optimization_groups")} | {
        "parallelism": "d", "transformer": "d"},
    "workflow": {k: "v" for k in (
        "generate_data", "train", "checkpoint", "evaluation", "profiling", "debug")},
    "dataset": {k: "v" for k in (
        "data_folder", "format", "num_files_train", "num_files_eval", "num_samples_per_file",
        "record_length", "record_length_bytes", "record_length_stdev",
        "record_length_bytes_stdev", "record_length_resize", "record_length_bytes_resize",
        "num_subfolders_train", "num_subfolders_eval", "file_prefix", "compression",
        "keep_files", "enable_chunking", "chunk_size")},
    "reader": {k: "v" for k in (
        "data_loader", "batch_size", "batch_size_eval", "read_threads", "computation_threads",
        "prefetch_size", "file_shuffle", "sample_shuffle", "shuffle_size", "transfer_size",
        "read_type", "preprocess_time", "preprocess_time_stdev", "odirect", "dont_use_mmap",
        "pin_memory", "multiprocessing_context", "data_loader_sampler")},
    "train": {k: "v" for k in (
        "epochs", "computation_time", "computation_time_stdev", "total_training_steps",
        "seed", "seed_change_epoch")},
    "evaluation": {k: "v" for k in (
        "eval_time", "eval_time_stdev", "eval_after_epoch", "epochs_between_evals")},
    "checkpoint": {k: "v" for k in (
        "checkpoint_folder", "checkpoint_after_epoch", "epochs_between_checkpoints",
        "steps_between_checkpoints", "model_size", "model_datatype", "optimizer_datatype",
        "time_between_checkpoints", "num_checkpoints_write", "num_checkpoints_read", "fsync",
        "type", "checkpoint_mechanism_classname")},
    "output": {k: "v" for k in ("folder", "log_file", "keep_files")},
    "metric": {k: "v" for k in ("au", "exclude_start_steps", "exclude_end_steps")},
    "storage": {k: "v" for k in ("storage_type", "storage_root")},
    "profiling": {k: "v" for k in ("profiler", "iostat_devices")},
}
_NESTED = {
    ("model", "parallelism"): ("tensor", "pipeline", "data", "zero_stage"),
    ("model", "transformer"): ("vocab_size", "hidden_size", "ffn_hidden_size",
                               "num_attention_heads", "num_kv_heads"),
}
_TOP = set(_SCHEMA) | {"framework"}

# Accepted (DLIO files carry them) but without effect on an emulation of the I/O: they tune a
# real framework's compute or DLIO's own bookkeeping. Listed in the run's notes.
_NO_EFFECT = {
    ("model", "type"), ("reader", "computation_threads"), ("reader", "shuffle_size"),
    ("reader", "pin_memory"), ("reader", "multiprocessing_context"),
    ("reader", "data_loader_sampler"), ("reader", "dont_use_mmap"),
    ("dataset", "record_length_resize"), ("dataset", "record_length_bytes_resize"),
    ("dataset", "enable_chunking"), ("dataset", "chunk_size"), ("dataset", "keep_files"),
    ("checkpoint", "checkpoint_mechanism_classname"), ("output", "log_file"),
    ("output", "keep_files"), ("workflow", "debug"), ("storage", "storage_root"),
    ("profiling", "profiler"), ("profiling", "iostat_devices"),
    ("model", "parallelism.data"),
}

# Bytes per element of the DLIO datatypes (checkpoint.model_datatype/optimizer_datatype).
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "fp64": 8, "int8": 1, "uint8": 1, "fp8": 1}


@dataclass
class Workload:
    """A resolved DLIO workload: every field has its DLIO default unless the file set it.

    Sizes are bytes; times are seconds. ``source`` is the file it came from (for messages).
    """

    source: str = "<dict>"
    model_name: str = "default"
    framework: str = "pytorch"
    # workflow
    generate_data: bool = False
    do_train: bool = True
    do_checkpoint: bool = False
    do_eval: bool = False
    # dataset
    data_folder: str = "./data/"
    format: str = "npz"
    num_files_train: int = 8
    num_files_eval: int = 0
    num_samples_per_file: int = 1
    record_length: int = 64 * 1024
    record_length_stdev: int = 0
    record_length_resize: int = 0
    num_subfolders_train: int = 0
    file_prefix: str = "img"
    keep_files: bool = True
    # reader
    batch_size: int = 1
    batch_size_eval: int = 1
    read_threads: int = 1
    prefetch_size: int = 2
    file_shuffle: str = "off"
    sample_shuffle: str = "off"
    transfer_size: int = 0
    odirect: bool = False
    preprocess_time: float = 0.0
    # train
    epochs: int = 1
    computation_time: float = 0.0
    computation_time_stdev: float = 0.0
    total_training_steps: int = -1
    seed: int = 123
    seed_change_epoch: bool = True
    # evaluation
    eval_time: float = 0.0
    eval_time_stdev: float = 0.0
    eval_after_epoch: int = 1
    epochs_between_evals: int = 1
    # checkpoint
    checkpoint_folder: str = "./checkpoints/"
    checkpoint_after_epoch: int = 1
    epochs_between_checkpoints: int = 1
    steps_between_checkpoints: int = -1
    time_between_checkpoints: float = -1.0
    num_checkpoints_write: int = -1
    num_checkpoints_read: int = -1
    checkpoint_fsync: bool = True
    checkpoint_type: str = "all_ranks"
    model_size: int = 0
    model_datatype: str = "fp16"
    optimizer_datatype: str = "fp32"
    num_layers: int = 0
    hidden_size: int = 0
    ffn_hidden_size: int = 0
    vocab_size: int = 0
    num_attention_heads: int = 0
    num_kv_heads: int = 0
    tensor_parallelism: int = 1
    pipeline_parallelism: int = 1
    data_parallelism: int = 0
    zero_stage: int = 0
    # output / metric
    output_folder: str = "./output/"
    au: float = 0.90
    exclude_start_steps: int = 1
    exclude_end_steps: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Every number a workload holds, with its range: (attribute, DLIO key, type, min, max). The
# key's "|" gives DLIO's other spelling (same section). The ranges hold every published DLIO
# (argonne-lcf/dlio_benchmark configs/workload, all versions) and MLPerf Storage v1.0/v2.0
# workload, whose largest values are: 1,281,167 files, 4,195,198,976 samples per file (an old
# dlrm), 640 MiB records, batch 2,048 (16,384 for evaluation), 8 read threads, 311,541 epochs,
# 8.99 s of compute per step, 126 layers, hidden 25,872, tensor 8 x pipeline 64. Beyond them
# they stop values that would allocate or run without end (``read_threads: 100000``,
# ``epochs: 1e12``), and negatives where only a sentinel -1 means something.
_RANGES: tuple[tuple[str, str, type, int, int], ...] = (
    ("model_size", "model.model_size|model_size_bytes", int, 0, 1 << 50),
    ("model_size", "checkpoint.model_size", int, 0, 1 << 50),  # older DLIO's place for it
    ("num_layers", "model.num_layers", int, 0, 10_000),
    ("tensor_parallelism", "model.parallelism.tensor", int, 1, 4096),
    ("pipeline_parallelism", "model.parallelism.pipeline", int, 1, 4096),
    ("data_parallelism", "model.parallelism.data", int, 0, 1 << 20),
    ("zero_stage", "model.parallelism.zero_stage", int, -1, 3),
    ("vocab_size", "model.transformer.vocab_size", int, 0, 1 << 24),
    ("hidden_size", "model.transformer.hidden_size", int, 0, 1 << 20),
    ("ffn_hidden_size", "model.transformer.ffn_hidden_size", int, 0, 1 << 22),
    ("num_attention_heads", "model.transformer.num_attention_heads", int, 0, 1 << 16),
    ("num_kv_heads", "model.transformer.num_kv_heads", int, 0, 1 << 16),
    ("num_files_train", "dataset.num_files_train", int, 1, 1 << 24),
    ("num_files_eval", "dataset.num_files_eval", int, 0, 1 << 24),
    ("num_samples_per_file", "dataset.num_samples_per_file", int, 1, 1 << 32),
    ("record_length", "dataset.record_length|record_length_bytes", int, 1, 1 << 36),
    ("record_length_stdev", "dataset.record_length_stdev|record_length_bytes_stdev", int, 0,
     1 << 36),
    ("record_length_resize", "dataset.record_length_resize|record_length_bytes_resize", int, 0,
     1 << 36),
    ("num_subfolders_train", "dataset.num_subfolders_train", int, 0, 1 << 20),
    ("batch_size", "reader.batch_size", int, 1, 1 << 20),
    ("batch_size_eval", "reader.batch_size_eval", int, 1, 1 << 20),
    ("read_threads", "reader.read_threads", int, 0, 256),
    ("prefetch_size", "reader.prefetch_size", int, 0, 1024),
    ("transfer_size", "reader.transfer_size", int, 0, 1 << 26),
    ("preprocess_time", "reader.preprocess_time", float, 0, 3600),
    ("epochs", "train.epochs", int, 1, 1_000_000),
    ("computation_time", "train.computation_time", float, 0, 3600),
    ("computation_time_stdev", "train.computation_time_stdev", float, 0, 3600),
    ("total_training_steps", "train.total_training_steps", int, -1, 1 << 40),
    ("seed", "train.seed", int, 0, 2**32 - 1),
    ("eval_time", "evaluation.eval_time", float, 0, 3600),
    ("eval_time_stdev", "evaluation.eval_time_stdev", float, 0, 3600),
    ("eval_after_epoch", "evaluation.eval_after_epoch", int, 0, 1_000_000),
    ("epochs_between_evals", "evaluation.epochs_between_evals", int, 0, 1_000_000),
    ("checkpoint_after_epoch", "checkpoint.checkpoint_after_epoch", int, 0, 1_000_000),
    ("epochs_between_checkpoints", "checkpoint.epochs_between_checkpoints", int, 0, 1_000_000),
    ("steps_between_checkpoints", "checkpoint.steps_between_checkpoints", int, -1, 1 << 40),
    ("time_between_checkpoints", "checkpoint.time_between_checkpoints", float, -1, 86_400),
    ("num_checkpoints_write", "checkpoint.num_checkpoints_write", int, -1, 10_000),
    ("num_checkpoints_read", "checkpoint.num_checkpoints_read", int, -1, 10_000),
    ("au", "metric.au", float, 0, 1),
    ("exclude_start_steps", "metric.exclude_start_steps", int, 0, 1 << 40),
    ("exclude_end_steps", "metric.exclude_end_steps", int, 0, 1 << 40),
)

#: Totals: samples of one epoch (its order is an array in memory), steps of a whole run, and
#: the time a run spends in its emulated compute and checkpoint pauses.
MAX_EPOCH_SAMPLES = 1 << 32
MAX_RUN_STEPS = 10**9
MAX_RUN_S = 31 * 86_400

_BOOLS = "a boolean (true or false)"
_MAX_TEXT = 4096  # strings are names and paths: PATH_MAX at most


def _err(source: str, msg: str) -> ConfigError:
    return ConfigError(f"{source}: {msg}")


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 2, 40, 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 3


def _show(value: Any) -> str:
    """A short one-line rendering of a value from a file, whatever its size or depth."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"a {value.bit_length()}-bit integer"
    if isinstance(value, str) and len(value) <= 40 and value.isprintable():
        return value
    return " ".join(_REPR.repr(value).split())


def _number(label: str, value: Any, kind: type, lo: int, hi: int, source: str) -> int | float:
    """``value`` as ``kind`` if it lies in ``lo..hi``; DLIO's float record lengths truncate."""
    bad = _err(source, f"{label} must be {'an integer' if kind is int else 'a number'} in "
               f"{lo}..{hi}, got {_show(value)}")
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise bad
    if isinstance(value, str):  # YAML 1.1 reads 1e12 (no dot) as a string
        try:
            value = int(value)
        except ValueError:
            try:
                value = float(value)
            except ValueError:
                raise bad from None
    if isinstance(value, float):
        if not math.isfinite(value):
            raise bad
        if kind is int:
            value = int(value)  # DLIO files hold record lengths such as 114660.07
    if not lo <= value <= hi:
        raise bad
    return kind(value)  # type: ignore[no-any-return]


def _as_bool(label: str, value: Any, source: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.lower() in ("true", "yes", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise _err(source, f"{label} must be {_BOOLS}, got {_show(value)}")


def _as_str(label: str, value: Any, source: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _err(source, f"{label} must be a string, got {_show(value)}")
    text = str(value)
    if len(text) > _MAX_TEXT or "\0" in text:
        raise _err(source, f"{label} must be a string of at most {_MAX_TEXT} characters "
                   "without NUL bytes")
    return text


def _check_keys(doc: dict[Any, Any], source: str) -> None:
    for top, body in doc.items():
        if top not in _TOP:
            raise _err(source, f"unknown section '{_show(top)}' (DLIO workload sections: "
                       f"{', '.join(sorted(_TOP))})")
        if top == "framework":
            continue
        if top == "model" and isinstance(body, str):
            continue  # DLIO allows `model: resnet50`
        if body is None:
            continue
        if not isinstance(body, dict):
            raise _err(source, f"section '{top}' must be a mapping of keys, not {_show(body)}")
        allowed = _SCHEMA[top]
        for key, value in body.items():
            if key not in allowed:
                hint = " (DLIO's key is 'epochs')" if (top, key) == ("train", "epoch") else ""
                raise _err(source, f"unknown key '{top}.{_show(key)}'{hint}; known keys of "
                           f"'{top}': {', '.join(sorted(allowed))}")
            if allowed[key] == "d" and value is not None:
                if not isinstance(value, dict):
                    raise _err(source, f"'{top}.{key}' must be a mapping")
                for sub in value:
                    if sub not in _NESTED[(top, key)]:
                        raise _err(source, f"unknown key '{top}.{key}.{_show(sub)}'; known: "
                                   f"{', '.join(_NESTED[(top, key)])}")


def _apply_override(doc: dict[str, Any], item: str) -> None:
    """``section.key=value`` (DLIO's ``++workload.section.key=value`` without the prefix)."""
    path, sep, raw = item.partition("=")
    if not sep:
        raise ConfigError(f"override {_show(item)} is not SECTION.KEY=VALUE")
    path = path.removeprefix("++").removeprefix("workload.")
    parts = path.split(".")
    node = doc
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = load_yaml(raw, f"--set {_show(path)}")


# --------------------------------------------------------------------------- parsing
def _lookup(sections: dict[str, Any], model: dict[str, Any],
            key: str) -> list[tuple[str, Any]]:
    """Values under ``section.key`` (or ``section.sub.key``) and its ``|`` spellings."""
    section, _, rest = key.partition(".")
    body: Any = model if section == "model" else sections.get(section, {})
    *parents, last = rest.split(".")
    for parent in parents:
        body = body.get(parent) if isinstance(body, dict) else None
    if not isinstance(body, dict):
        return []
    return [(k, body[k]) for k in last.split("|") if body.get(k) is not None]


def _pick(source: str, section: str, found: list[tuple[str, Any]]) -> Any:
    """The one value of a key given in one or two spellings (converted), or None."""
    if len(found) > 1 and found[0][1] != found[1][1]:
        raise _err(source, f"'{section}.{found[0][0]}' = {_show(found[0][1])} and "
                   f"'{section}.{found[1][0]}' = {_show(found[1][1])} disagree; keep one")
    return found[0][1] if found else None


def parse_workload(doc: dict[str, Any], source: str = "<dict>",
                   overrides: tuple[str, ...] | list[str] = ()) -> Workload:
    """Validate a DLIO workload mapping and resolve it into a :class:`Workload`.

    Every number is checked against its range (``_RANGES``) and the totals against theirs
    before anything is allocated or written.

    Args:
        doc: the YAML document (the ``workload`` mapping of DLIO's Hydra config).
        source: where it came from, named in every error message.
        overrides: ``section.key=value`` strings applied before validation.

    Raises:
        ConfigError: an unknown or unsupported key, a value of the wrong type or out of range.
    """
    if not isinstance(doc, dict):
        raise _err(source, "a DLIO workload file is a YAML mapping of sections")
    if "workload" in doc and isinstance(doc["workload"], dict) and len(doc) == 1:
        doc = doc["workload"]
    doc = {k: (dict(v) if isinstance(v, dict) else v) for k, v in doc.items()}
    for item in overrides:
        _apply_override(doc, item)
    _check_keys(doc, source)
    w = Workload(source=source)
    for (sec_name, key) in sorted(_NO_EFFECT):
        body = doc.get(sec_name)
        head, _, sub = key.partition(".")
        if isinstance(body, dict) and head in body and (
                not sub or (isinstance(body[head], dict) and sub in body[head])):
            w.notes.append(f"{sec_name}.{key} has no effect on the emulated I/O")
    sec = {k: (v or {}) for k, v in doc.items() if k != "framework"}
    model = sec.get("model", {})
    if isinstance(model, str):
        model = {"name": model}

    for attr, key, kind, lo, hi in _RANGES:
        prefix = key.partition("|")[0].rpartition(".")[0]  # model.parallelism for .tensor
        found = [(k, _number(f"{prefix}.{k}", v, kind, lo, hi, source))
                 for k, v in _lookup(sec, model, key)]
        if found:
            setattr(w, attr, _pick(source, prefix, found))

    def get(section: str, *keys: str) -> Any:
        return _pick(source, section, _lookup(sec, model, f"{section}.{'|'.join(keys)}"))

    def set_str(attr: str, section: str, key: str) -> None:
        value = get(section, key)
        if value is not None:
            setattr(w, attr, _as_str(f"{section}.{key}", value, source))

    def set_bool(attr: str, section: str, key: str) -> None:
        value = get(section, key)
        if value is not None:
            setattr(w, attr, _as_bool(f"{section}.{key}", value, source))

    framework = doc.get("framework")
    w.framework = "pytorch" if framework is None else _as_str("framework", framework, source)
    if w.framework not in ("pytorch", "tensorflow"):
        raise _err(source, f"framework '{w.framework}' is not supported; use pytorch or "
                   "tensorflow (both are emulated the same way: I/O plus a sleep)")
    set_str("model_name", "model", "name")
    for attr in ("model_datatype", "optimizer_datatype"):
        set_str(attr, "model", attr)
        set_str(attr, "checkpoint", attr)
        if getattr(w, attr) not in DTYPE_BYTES:
            raise _err(source, f"'{attr}' = {_show(getattr(w, attr))}; use one of "
                       f"{', '.join(DTYPE_BYTES)}")
    for bad in ("layer_parameters", "optimization_groups"):
        if model.get(bad):
            raise _err(source, f"'model.{bad}' (DLIO's legacy predefined tensor list) is not "
                       "supported; describe the model with num_layers and model.transformer")
    set_bool("generate_data", "workflow", "generate_data")
    set_bool("do_train", "workflow", "train")
    set_bool("do_checkpoint", "workflow", "checkpoint")
    set_bool("do_eval", "workflow", "evaluation")
    profiling = get("workflow", "profiling")
    if profiling is not None and _as_bool("workflow.profiling", profiling, source):
        w.notes.append("workflow.profiling is ignored: use --trace for lcache's tracer")

    set_str("data_folder", "dataset", "data_folder")
    set_str("format", "dataset", "format")
    set_str("file_prefix", "dataset", "file_prefix")
    set_bool("keep_files", "dataset", "keep_files")
    comp = get("dataset", "compression")
    if comp not in (None, "none"):
        raise _err(source, f"'dataset.compression' = {_show(comp)} is not supported; use none")
    if w.format in _DLIO_ONLY_FORMATS:
        raise _err(source, f"'dataset.format' = {w.format!r} is a DLIO format this emulator "
                   f"does not implement; use one of {', '.join(FORMATS)}")
    if w.format not in FORMATS:
        raise _err(source, f"'dataset.format' = {_show(w.format)} is unknown; use one of "
                   f"{', '.join(FORMATS)}")
    if w.num_subfolders_train:
        raise _err(source, "'dataset.num_subfolders_train' > 0 is not supported; put the "
                   "files in one folder (num_subfolders_train: 0)")

    loader = get("reader", "data_loader")
    if loader not in (None, "pytorch", "tensorflow"):
        raise _err(source, f"'reader.data_loader' = {_show(loader)} is not supported; use "
                   "pytorch or tensorflow")
    set_str("file_shuffle", "reader", "file_shuffle")
    set_str("sample_shuffle", "reader", "sample_shuffle")
    set_bool("odirect", "reader", "odirect")
    read_type = get("reader", "read_type")
    if read_type not in (None, "on_demand"):
        raise _err(source, f"'reader.read_type' = {_show(read_type)} is not supported; use "
                   "on_demand")
    for key in ("file_shuffle", "sample_shuffle"):
        if getattr(w, key) not in ("off", "seed", "random"):
            raise _err(source, f"'reader.{key}' = {_show(getattr(w, key))}; use off, seed or "
                       "random")
    set_bool("seed_change_epoch", "train", "seed_change_epoch")
    if w.do_eval and (w.num_files_eval < 1 or w.batch_size_eval < 1):
        raise _err(source, "workflow.evaluation is on: set dataset.num_files_eval and "
                   "reader.batch_size_eval to 1 or more")

    set_str("checkpoint_folder", "checkpoint", "checkpoint_folder")
    set_bool("checkpoint_fsync", "checkpoint", "fsync")
    set_str("checkpoint_type", "checkpoint", "type")
    if w.checkpoint_type not in ("all_ranks", "rank_zero"):
        raise _err(source, f"'checkpoint.type' = {_show(w.checkpoint_type)}; use all_ranks "
                   "or rank_zero")

    set_str("output_folder", "output", "folder")
    storage_type = get("storage", "storage_type")
    if storage_type not in (None, "local_fs"):
        raise _err(source, f"'storage.storage_type' = {_show(storage_type)} is not supported; "
                   "lcache bench measures a local path (local_fs)")
    _validate(w)
    return w


def _validate(w: Workload) -> None:
    src = w.source
    if w.au <= 0:
        raise _err(src, f"metric.au = {w.au} must be a fraction in (0, 1], e.g. 0.90")
    if w.do_checkpoint and w.model_size <= 0 and w.num_layers <= 0:
        raise _err(src, "workflow.checkpoint is on but the checkpoint has no size: set "
                   "model.model_size (bytes) or model.num_layers with model.transformer")
    if w.num_layers > 0 and min(w.hidden_size, w.ffn_hidden_size, w.vocab_size) <= 0:
        raise _err(src, "model.num_layers is set: also set model.transformer.hidden_size, "
                   "ffn_hidden_size and vocab_size")
    for split, files, on in (("train", w.num_files_train, w.do_train),
                             ("eval", w.num_files_eval, w.do_eval)):
        if on and files * w.num_samples_per_file > MAX_EPOCH_SAMPLES:
            raise _err(src, f"dataset.num_files_{split} x num_samples_per_file = "
                       f"{files * w.num_samples_per_file} samples; at most "
                       f"{MAX_EPOCH_SAMPLES} per epoch (an epoch's order is held in memory)")
    if w.do_checkpoint and not w.do_train:
        check_run_length(w, 0, 0)


def check_run_length(w: Workload, steps_per_epoch: int, eval_steps_per_epoch: int) -> None:
    """Refuse a run of more than ``MAX_RUN_STEPS`` steps, or whose emulated compute and
    checkpoint pauses alone last more than ``MAX_RUN_S`` (a month).

    Args:
        steps_per_epoch: this rank's training steps per epoch (0: a checkpoint-only run).
        eval_steps_per_epoch: its evaluation steps after an epoch (0: none).
    """
    steps = w.epochs * (steps_per_epoch + eval_steps_per_epoch) if w.do_train else 0
    seconds = w.epochs * (steps_per_epoch * w.computation_time
                          + eval_steps_per_epoch * w.eval_time) if w.do_train else 0.0
    if w.do_checkpoint and not w.do_train:
        seconds += max(0, w.num_checkpoints_write - 1) * max(0.0, w.time_between_checkpoints)
    if steps > MAX_RUN_STEPS:
        raise _err(w.source, f"train.epochs = {w.epochs} x {steps // w.epochs} steps per epoch "
                   f"make {steps} steps, more than {MAX_RUN_STEPS}; lower train.epochs or "
                   "set train.total_training_steps")
    if seconds > MAX_RUN_S:
        raise _err(w.source, f"this run would sleep {seconds / 86_400:,.0f} days in emulated "
                   f"compute and checkpoint pauses, more than {MAX_RUN_S // 86_400} days; lower "
                   "train.epochs, computation_time or num_checkpoints_write")


def load_workload(path: str, overrides: tuple[str, ...] | list[str] = ()) -> Workload:
    """Read and validate a DLIO workload YAML file (see :func:`parse_workload`).

    Raises:
        ConfigError: the file is missing, not a regular file, over 1 MiB, not plain YAML
            (tags, aliases), or its workload is invalid.
    """
    hint = "; `lcache bench configs` lists the shipped ones"
    doc = load_yaml(read_file(path, "workload", hint), path)
    return parse_workload(doc, source=path, overrides=overrides)


def shipped_configs() -> dict[str, str]:
    """The workload files shipped in ``lcache/bench/configs``: name -> path."""
    from importlib import resources

    root = resources.files("lcache.bench") / "configs"
    out = {}
    for entry in root.iterdir():
        if entry.name.endswith(".yaml"):
            out[entry.name[:-5]] = str(entry)
    return dict(sorted(out.items()))


def resolve_config(name_or_path: str) -> str:
    """A path as given, or the shipped config of that name (``unet3d_h100``)."""
    if os.path.exists(name_or_path):
        return name_or_path
    shipped = shipped_configs()
    key = name_or_path.removesuffix(".yaml")
    if key in shipped:
        return shipped[key]
    raise ConfigError(f"{name_or_path} is neither a file nor a shipped config; shipped: "
                      f"{', '.join(shipped)}")
