"""DLIO workload YAML: parse, validate and resolve into one typed :class:`Workload`.

The sections and key names are those of the DLIO benchmark (argonne-lcf/dlio_benchmark,
``dlio_benchmark/utils/config.py`` and its ``configs/workload/*.yaml``), so a DLIO or MLPerf
Storage workload file runs here unchanged. Two deliberate differences from DLIO:

* an unknown key is an error that names the key and the file (DLIO 2.0.0 silently drops it, so a
  typo such as ``train.epoch`` quietly runs the default epoch count);
* a key DLIO knows but this emulator does not implement (``storage_type: s3``, ``format: hdf5``)
  is refused rather than ignored.

DLIO versions spell the record size two ways: 2.0.0 reads ``dataset.record_length`` and ignores
``record_length_bytes``; newer DLIO reads the latter. Both are accepted (the same for ``_stdev``
and ``_resize``); giving both with different values is an error.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

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


def _err(source: str, msg: str) -> ConfigError:
    return ConfigError(f"{source}: {msg}")


def _check_keys(doc: dict[str, Any], source: str) -> None:
    for top, body in doc.items():
        if top not in _TOP:
            raise _err(source, f"unknown section '{top}' (DLIO workload sections: "
                       f"{', '.join(sorted(_TOP))})")
        if top == "framework":
            continue
        if top == "model" and isinstance(body, str):
            continue  # DLIO allows `model: resnet50`
        if body is None:
            continue
        if not isinstance(body, dict):
            raise _err(source, f"section '{top}' must be a mapping of keys, not {body!r}")
        allowed = _SCHEMA[top]
        for key, value in body.items():
            if key not in allowed:
                hint = " (DLIO's key is 'epochs')" if (top, key) == ("train", "epoch") else ""
                raise _err(source, f"unknown key '{top}.{key}'{hint}; known keys of '{top}': "
                           f"{', '.join(sorted(allowed))}")
            if allowed[key] == "d":
                if not isinstance(value, dict):
                    raise _err(source, f"'{top}.{key}' must be a mapping")
                for sub in value:
                    if sub not in _NESTED[(top, key)]:
                        raise _err(source, f"unknown key '{top}.{key}.{sub}'; known: "
                                   f"{', '.join(_NESTED[(top, key)])}")


def _apply_override(doc: dict[str, Any], item: str, source: str) -> None:
    """``section.key=value`` (DLIO's ``++workload.section.key=value`` without the prefix)."""
    path, sep, raw = item.partition("=")
    if not sep:
        raise ConfigError(f"override {item!r} is not SECTION.KEY=VALUE")
    path = path.removeprefix("++").removeprefix("workload.")
    parts = path.split(".")
    node = doc
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = yaml.safe_load(raw)


def parse_workload(doc: dict[str, Any], source: str = "<dict>",
                   overrides: tuple[str, ...] | list[str] = ()) -> Workload:
    """Validate a DLIO workload mapping and resolve it into a :class:`Workload`.

    Args:
        doc: the YAML document (the ``workload`` mapping of DLIO's Hydra config).
        source: where it came from, named in every error message.
        overrides: ``section.key=value`` strings applied before validation.

    Raises:
        ConfigError: an unknown or unsupported key, or a value out of range.
    """
    if not isinstance(doc, dict):
        raise _err(source, "a DLIO workload file is a YAML mapping of sections")
    if "workload" in doc and isinstance(doc["workload"], dict) and len(doc) == 1:
        doc = doc["workload"]
    doc = {k: (dict(v) if isinstance(v, dict) else v) for k, v in doc.items()}
    for item in overrides:
        _apply_override(doc, item, source)
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

    def get(section: str, *keys: str) -> Any:
        body = model if section == "model" else sec.get(section, {})
        found = [(k, body[k]) for k in keys if k in body]
        if len(found) > 1 and found[0][1] != found[1][1]:
            raise _err(source, f"'{section}.{found[0][0]}' = {found[0][1]!r} and "
                       f"'{section}.{found[1][0]}' = {found[1][1]!r} disagree; keep one")
        return found[0][1] if found else None

    def setv(attr: str, section: str, *keys: str, conv: Any = None) -> None:
        value = get(section, *keys)
        if value is None:
            return
        try:
            value = conv(value) if conv else value
        except (TypeError, ValueError) as exc:
            raise _err(source, f"'{section}.{keys[0]}' = {value!r} is not a valid "
                       f"{conv.__name__ if conv else 'value'}") from exc
        setattr(w, attr, value)

    w.framework = str(doc.get("framework", "pytorch"))
    if w.framework not in ("pytorch", "tensorflow"):
        raise _err(source, f"framework '{w.framework}' is not supported; use pytorch or "
                   "tensorflow (both are emulated the same way: I/O plus a sleep)")
    setv("model_name", "model", "name", conv=str)
    setv("model_size", "model", "model_size", "model_size_bytes", conv=_as_int)
    setv("num_layers", "model", "num_layers", conv=_as_int)
    setv("model_datatype", "model", "model_datatype", conv=str)
    setv("optimizer_datatype", "model", "optimizer_datatype", conv=str)
    for bad in ("layer_parameters", "optimization_groups"):
        if model.get(bad):
            raise _err(source, f"'model.{bad}' (DLIO's legacy predefined tensor list) is not "
                       "supported; describe the model with num_layers and model.transformer")
    par = model.get("parallelism") or {}
    tr = model.get("transformer") or {}
    for attr, key in (("tensor_parallelism", "tensor"), ("pipeline_parallelism", "pipeline"),
                      ("data_parallelism", "data"), ("zero_stage", "zero_stage")):
        if key in par:
            setattr(w, attr, _as_int(par[key]))
    for key in ("vocab_size", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "num_kv_heads"):
        if key in tr:
            setattr(w, key, _as_int(tr[key]))
    setv("generate_data", "workflow", "generate_data", conv=_as_bool)
    setv("do_train", "workflow", "train", conv=_as_bool)
    setv("do_checkpoint", "workflow", "checkpoint", conv=_as_bool)
    setv("do_eval", "workflow", "evaluation", conv=_as_bool)
    if _as_bool(sec.get("workflow", {}).get("profiling", False)):
        w.notes.append("workflow.profiling is ignored: use --trace for lcache's tracer")

    setv("data_folder", "dataset", "data_folder", conv=str)
    setv("format", "dataset", "format", conv=str)
    setv("num_files_train", "dataset", "num_files_train", conv=_as_int)
    setv("num_files_eval", "dataset", "num_files_eval", conv=_as_int)
    setv("num_samples_per_file", "dataset", "num_samples_per_file", conv=_as_int)
    setv("record_length", "dataset", "record_length", "record_length_bytes", conv=_as_int)
    setv("record_length_stdev", "dataset", "record_length_stdev", "record_length_bytes_stdev",
         conv=_as_int)
    setv("record_length_resize", "dataset", "record_length_resize",
         "record_length_bytes_resize", conv=_as_int)
    setv("num_subfolders_train", "dataset", "num_subfolders_train", conv=_as_int)
    setv("file_prefix", "dataset", "file_prefix", conv=str)
    setv("keep_files", "dataset", "keep_files", conv=_as_bool)
    comp = get("dataset", "compression")
    if comp not in (None, "none"):
        raise _err(source, f"'dataset.compression' = {comp!r} is not supported; use none")
    if w.format in _DLIO_ONLY_FORMATS:
        raise _err(source, f"'dataset.format' = {w.format!r} is a DLIO format this emulator "
                   f"does not implement; use one of {', '.join(FORMATS)}")
    if w.format not in FORMATS:
        raise _err(source, f"'dataset.format' = {w.format!r} is unknown; use one of "
                   f"{', '.join(FORMATS)}")
    if w.num_subfolders_train:
        raise _err(source, "'dataset.num_subfolders_train' > 0 is not supported; put the "
                   "files in one folder (num_subfolders_train: 0)")

    loader = get("reader", "data_loader")
    if loader not in (None, "pytorch", "tensorflow"):
        raise _err(source, f"'reader.data_loader' = {loader!r} is not supported; use pytorch "
                   "or tensorflow")
    setv("batch_size", "reader", "batch_size", conv=_as_int)
    setv("batch_size_eval", "reader", "batch_size_eval", conv=_as_int)
    setv("read_threads", "reader", "read_threads", conv=_as_int)
    setv("prefetch_size", "reader", "prefetch_size", conv=_as_int)
    setv("file_shuffle", "reader", "file_shuffle", conv=str)
    setv("sample_shuffle", "reader", "sample_shuffle", conv=str)
    setv("transfer_size", "reader", "transfer_size", conv=_as_int)
    setv("odirect", "reader", "odirect", conv=_as_bool)
    setv("preprocess_time", "reader", "preprocess_time", conv=float)
    read_type = get("reader", "read_type")
    if read_type not in (None, "on_demand"):
        raise _err(source, f"'reader.read_type' = {read_type!r} is not supported; use "
                   "on_demand")
    for key in ("file_shuffle", "sample_shuffle"):
        if getattr(w, key) not in ("off", "seed", "random"):
            raise _err(source, f"'reader.{key}' = {getattr(w, key)!r}; use off, seed or random")

    setv("epochs", "train", "epochs", conv=_as_int)
    setv("computation_time", "train", "computation_time", conv=float)
    setv("computation_time_stdev", "train", "computation_time_stdev", conv=float)
    setv("total_training_steps", "train", "total_training_steps", conv=_as_int)
    setv("seed", "train", "seed", conv=_as_int)
    setv("seed_change_epoch", "train", "seed_change_epoch", conv=_as_bool)
    setv("eval_time", "evaluation", "eval_time", conv=float)
    setv("eval_time_stdev", "evaluation", "eval_time_stdev", conv=float)
    setv("eval_after_epoch", "evaluation", "eval_after_epoch", conv=_as_int)
    setv("epochs_between_evals", "evaluation", "epochs_between_evals", conv=_as_int)
    if w.do_eval and (w.num_files_eval < 1 or w.batch_size_eval < 1):
        raise _err(source, "workflow.evaluation is on: set dataset.num_files_eval and "
                   "reader.batch_size_eval to 1 or more")

    setv("checkpoint_folder", "checkpoint", "checkpoint_folder", conv=str)
    setv("checkpoint_after_epoch", "checkpoint", "checkpoint_after_epoch", conv=_as_int)
    setv("epochs_between_checkpoints", "checkpoint", "epochs_between_checkpoints",
         conv=_as_int)
    setv("steps_between_checkpoints", "checkpoint", "steps_between_checkpoints", conv=_as_int)
    setv("time_between_checkpoints", "checkpoint", "time_between_checkpoints", conv=float)
    setv("num_checkpoints_write", "checkpoint", "num_checkpoints_write", conv=_as_int)
    setv("num_checkpoints_read", "checkpoint", "num_checkpoints_read", conv=_as_int)
    setv("checkpoint_fsync", "checkpoint", "fsync", conv=_as_bool)
    ck_size = get("checkpoint", "model_size")
    if ck_size is not None:  # older DLIO: checkpoint.model_size; newer: model.model_size
        w.model_size = _as_int(ck_size)
    setv("model_datatype", "checkpoint", "model_datatype", conv=str)
    setv("optimizer_datatype", "checkpoint", "optimizer_datatype", conv=str)
    for attr in ("model_datatype", "optimizer_datatype"):
        if getattr(w, attr) not in DTYPE_BYTES:
            raise _err(source, f"'{attr}' = {getattr(w, attr)!r}; use one of "
                       f"{', '.join(DTYPE_BYTES)}")
    setv("checkpoint_type", "checkpoint", "type", conv=str)
    if w.checkpoint_type not in ("all_ranks", "rank_zero"):
        raise _err(source, f"'checkpoint.type' = {w.checkpoint_type!r}; use all_ranks or "
                   "rank_zero")

    setv("output_folder", "output", "folder", conv=str)
    setv("au", "metric", "au", conv=float)
    setv("exclude_start_steps", "metric", "exclude_start_steps", conv=_as_int)
    setv("exclude_end_steps", "metric", "exclude_end_steps", conv=_as_int)
    storage_type = get("storage", "storage_type")
    if storage_type not in (None, "local_fs"):
        raise _err(source, f"'storage.storage_type' = {storage_type!r} is not supported; "
                   "lcache bench measures a local path (local_fs)")
    _validate(w)
    return w


def _validate(w: Workload) -> None:
    src = w.source
    positive = ("num_files_train", "num_samples_per_file", "batch_size", "epochs")
    for name in positive:
        if getattr(w, name) < 1:
            raise _err(src, f"{name} = {getattr(w, name)} must be at least 1")
    if w.do_train and w.record_length < 1:
        raise _err(src, f"record_length = {w.record_length} must be at least 1 byte")
    if w.read_threads < 0:
        raise _err(src, "reader.read_threads must be 0 or more")
    if w.computation_time < 0:
        raise _err(src, "train.computation_time must not be negative")
    if not 0 < w.au <= 1:
        raise _err(src, f"metric.au = {w.au} must be a fraction in (0, 1], e.g. 0.90")
    if w.do_checkpoint and w.model_size <= 0 and w.num_layers <= 0:
        raise _err(src, "workflow.checkpoint is on but the checkpoint has no size: set "
                   "model.model_size (bytes) or model.num_layers with model.transformer")
    if w.num_layers > 0 and min(w.hidden_size, w.ffn_hidden_size, w.vocab_size) <= 0:
        raise _err(src, "model.num_layers is set: also set model.transformer.hidden_size, "
                   "ffn_hidden_size and vocab_size")


def _as_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(value)
    return int(float(value))  # DLIO files hold record lengths such as 114660.07


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.lower() in ("true", "yes", "1")
    if isinstance(value, int):
        return bool(value)
    raise ValueError(value)


def load_workload(path: str, overrides: tuple[str, ...] | list[str] = ()) -> Workload:
    """Read and validate a DLIO workload YAML file (see :func:`parse_workload`)."""
    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except FileNotFoundError as exc:
        raise ConfigError(f"workload file {path} does not exist; `lcache bench configs` lists "
                          "the shipped ones") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
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
