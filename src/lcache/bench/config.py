"""DLIO workload YAML: parse, validate and resolve into one typed :class:`Workload`.

The sections, key names and defaults are DLIO's (argonne-lcf/dlio_benchmark at commit e1919d7b,
``dlio_benchmark/utils/config.py``; the tables are in ``schema.py``), so a DLIO or MLPerf
Storage workload file runs here unchanged. Deliberate differences from DLIO (docs/bench.md
lists them all):

* an unknown key is an error that names the key and the file (DLIO silently drops it, so a
  typo such as ``train.epoch`` quietly runs the default epoch count);
* a key DLIO knows but this emulator does not implement (``format: hdf5``) is refused rather
  than ignored;
* every number is checked against its range and the totals against theirs, and the YAML is
  plain (``yamlfile``: no tags, no aliases, bounded size and depth), so bad input is one
  ``ConfigError``, never a traceback, a hang or a runaway allocation;
* both spellings of the record size are read: DLIO 2.0.0 reads ``dataset.record_length``,
  newer DLIO ``record_length_bytes`` (the same for ``_stdev`` and ``_resize``); giving both
  with different values is an error; likewise ``model.model_size_bytes`` and 2.0.0's
  ``checkpoint.model_size``;
* ``--set dataset.record_length_bytes=N`` without a new ``_stdev`` scales the file's spread
  by the same factor (a note says so), so a shrunk unet3d keeps its shape instead of a spread
  many times its mean.
"""

from __future__ import annotations

import dataclasses
import math
import os
import reprlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lcache.bench.schema import (
    BYTE_ATTRS,
    DLIO_ONLY_FORMATS,
    DLIO_ONLY_LOADERS,
    DTYPE_BYTES,
    FORMATS,
    LIST_MAX_LEN,
    LIST_MAX_VALUE,
    LOADERS,
    MAX_EPOCH_SAMPLES,
    MAX_RUN_S,
    MAX_RUN_STEPS,
    MISPLACED,
    NESTED,
    NO_EFFECT,
    RANGES,
    SCHEMA,
    TOP,
)
from lcache.bench.yamlfile import load_yaml, read_file
from lcache.errors import ConfigError

__all__ = ["DTYPE_BYTES", "FORMATS", "MAX_EPOCH_SAMPLES", "MAX_RUN_S", "MAX_RUN_STEPS",
           "Workload", "check_run_length", "load_workload", "parse_workload",
           "resolve_config", "shipped_configs"]


@dataclass
class Workload:
    """A resolved DLIO workload: every field has DLIO's default unless the file set it.

    Sizes are bytes; times are seconds. ``source`` is the file it came from (for messages).
    ``data_loader`` is ``reader.data_loader``, or the framework's loader when unset.
    """

    source: str = "<dict>"
    model_name: str = "default"
    model_type: str = ""
    framework: str = "tensorflow"
    data_loader: str = "tensorflow"
    # workflow
    generate_data: bool = False
    do_train: bool = True
    do_checkpoint: bool = False
    do_eval: bool = False
    # dataset
    data_folder: str = "./data/"
    format: str = "tfrecord"
    num_files_train: int = 8
    num_files_eval: int = 0
    num_samples_per_file: int = 1
    record_length: int = 64 * 1024
    record_length_stdev: int = 0
    record_length_resize: int = 0
    num_subfolders_train: int = 0
    num_subfolders_eval: int = 0
    file_prefix: str = "img"
    keep_files: bool = True
    # reader
    batch_size: int = 1
    batch_size_eval: int = 1
    read_threads: int = 1
    prefetch_size: int = 2
    file_shuffle: str = "off"
    sample_shuffle: str = "off"
    shuffle_size: int = 1024
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
    checkpoint_mode: str = "default"
    model_size: int = 10240
    model_datatype: str = "fp16"
    optimizer_datatype: str = "fp32"
    num_layers: int = 0
    hidden_size: int = 2048
    ffn_hidden_size: int = 8192
    vocab_size: int = 32000
    num_attention_heads: int = 32
    num_kv_heads: int = 8
    tensor_parallelism: int = 1
    pipeline_parallelism: int = 1
    data_parallelism: int = 0
    zero_stage: int = 0
    layer_parameters: tuple[int, ...] = ()
    optimization_groups: tuple[int, ...] = ()
    # storage
    storage_type: str = "local_fs"
    storage_root: str = ""
    storage_options: dict[str, Any] = field(default_factory=dict)
    s3_max_attempts: int = 5
    # output / metric
    output_folder: str = "./output/"
    au: float = 0.90
    exclude_start_steps: int = 1
    exclude_end_steps: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def on_s3(self) -> bool:
        return self.storage_type == "s3"


# The parser's helpers: get(section, *keys) -> value; set_x(attribute, section, key).
_Get = Callable[..., Any]
_Set = Callable[[str, str, str], None]

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


def _number(label: str, value: Any, kind: type, lo: int, hi: int, source: str,
            size: bool = False, fraction: bool = False) -> int | float:
    """``value`` as ``kind`` if it lies in ``lo..hi``; an integer may be written ``4096.0``.

    Args:
        size: the value is a byte count, which may also be written as ``8MiB``.
        fraction: an integer may have a fraction, which is dropped (record lengths: MLPerf's
            resnet50 files give 114660.07, which DLIO also rounds down).
    """
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
                if not size:
                    raise bad from None
                from lcache.store.layout import parse_size

                try:
                    value = parse_size(value.strip())
                except ConfigError:
                    raise bad from None
    if isinstance(value, float):
        if not math.isfinite(value):
            raise bad
        if kind is int:
            if not (fraction or value.is_integer()):
                # DLIO fails on `epochs: 1.5` (range() of a float); truncating ran 1 epoch
                raise _err(source, f"{label} must be a whole number, got {_show(value)}")
            value = int(value)
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


def _int_list(label: str, value: Any, source: str) -> tuple[int, ...]:
    """DLIO's legacy tensor lists: integers, each 0..2^40, at most 1,024 of them."""
    if not isinstance(value, list) or len(value) > LIST_MAX_LEN:
        raise _err(source, f"{label} must be a list of at most {LIST_MAX_LEN} integers, got "
                   f"{_show(value)}")
    return tuple(int(_number(f"{label}[{i}]", v, int, 0, LIST_MAX_VALUE, source))
                 for i, v in enumerate(value))


def _check_keys(doc: dict[Any, Any], source: str) -> None:
    for top, body in doc.items():
        if top not in TOP:
            raise _err(source, f"unknown section '{_show(top)}' (DLIO workload sections: "
                       f"{', '.join(sorted(TOP))})")
        if top == "framework":
            continue
        if top == "model" and isinstance(body, str):
            continue  # DLIO allows `model: resnet50`
        if body is None:
            continue
        if not isinstance(body, dict):
            raise _err(source, f"section '{top}' must be a mapping of keys, not {_show(body)}")
        allowed = SCHEMA[top]
        for key, value in body.items():
            if key not in allowed:
                right = MISPLACED.get((top, key)) if isinstance(key, str) else None
                hint = f" (DLIO's key is '{right}')" if right else ""
                raise _err(source, f"unknown key '{top}.{_show(key)}'{hint}; known keys of "
                           f"'{top}': {', '.join(sorted(allowed))}")
            if allowed[key] != "d":
                _check_given(source, f"{top}.{key}", value)
            elif value is not None:
                if not isinstance(value, dict):
                    raise _err(source, f"'{top}.{key}' must be a mapping")
                for sub in value:
                    if sub not in NESTED[(top, key)]:
                        raise _err(source, f"unknown key '{top}.{key}.{_show(sub)}'; known: "
                                   f"{', '.join(NESTED[(top, key)])}")
                    _check_given(source, f"{top}.{key}.{sub}", value[sub])


def _check_given(source: str, key: str, value: Any) -> None:
    """A key given without a value (``batch_size:``, ``~``, ``""``) is refused: it would
    fall back to the default silently, and an empty folder would be the current directory."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise _err(source, f"'{key}' is given without a value; give one or remove the key")


def _apply_override(doc: dict[str, Any], item: str) -> tuple[str, ...]:
    """``section.key=value`` (DLIO's ``++workload.section.key=value`` without the prefix);
    returns the key's path."""
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
    return tuple(parts)


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


def _copy(doc: Any) -> Any:
    """A copy of the mappings of ``doc`` (overrides must not change the caller's)."""
    return {k: _copy(v) for k, v in doc.items()} if isinstance(doc, dict) else doc


def parse_workload(doc: dict[str, Any], source: str = "<dict>",
                   overrides: tuple[str, ...] | list[str] = ()) -> Workload:
    """Validate a DLIO workload mapping and resolve it into a :class:`Workload`.

    Every number is checked against its range (``schema.RANGES``) and the totals against
    theirs before anything is allocated or written.

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
    doc = _copy(doc)
    file_length = _record_length_of(doc, source)
    if not isinstance(overrides, (list, tuple)) or \
            not all(isinstance(item, str) for item in overrides):
        # a str was walked a character at a time: "override a is not SECTION.KEY=VALUE"
        raise ConfigError(f"overrides={overrides!r:.200}: give a list of SECTION.KEY=VALUE "
                          "strings, such as ['train.epochs=2']")
    overridden = {_apply_override(doc, item) for item in overrides}
    _check_keys(doc, source)
    w = Workload(source=source)
    _note_no_effect(doc, w)
    sec = {k: (v or {}) for k, v in doc.items() if k != "framework"}
    model = sec.get("model", {})
    if isinstance(model, str):
        model = {"name": model}

    set_by: dict[str, tuple[str, Any]] = {}
    for attr, key, kind, lo, hi in RANGES:
        prefix = key.partition("|")[0].rpartition(".")[0]  # model.parallelism for .tensor
        fraction = attr in _FRACTIONAL
        found = [(k, _number(f"{prefix}.{k}", v, kind, lo, hi, source, attr in BYTE_ATTRS,
                             fraction))
                 for k, v in _lookup(sec, model, key)]
        for k, v in _lookup(sec, model, key) if fraction else ():
            _note_fraction(w, f"{prefix}.{k}", v)
        if found:
            value = _pick(source, prefix, found)
            if attr in set_by and set_by[attr][1] != value:
                raise _err(source, f"'{set_by[attr][0]}' = {set_by[attr][1]} and "
                           f"'{prefix}.{found[0][0]}' = {value} disagree; keep one")
            set_by[attr] = (f"{prefix}.{found[0][0]}", value)
            setattr(w, attr, value)

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

    _parse_model(w, doc, model, source, set_str)
    set_bool("generate_data", "workflow", "generate_data")
    set_bool("do_train", "workflow", "train")
    set_bool("do_checkpoint", "workflow", "checkpoint")
    set_bool("do_eval", "workflow", "evaluation")
    profiling = get("workflow", "profiling")
    if profiling is not None and _as_bool("workflow.profiling", profiling, source):
        w.notes.append("workflow.profiling is ignored: use --trace for lcache's tracer")
    _parse_dataset(w, get, set_str, set_bool, source)
    _parse_reader(w, get, set_str, set_bool, source)
    set_bool("seed_change_epoch", "train", "seed_change_epoch")
    _parse_checkpoint(w, get, set_str, set_bool, source)
    set_str("output_folder", "output", "folder")
    _parse_storage(w, sec, get, set_str, source)
    _scale_spread(w, file_length, overridden)
    _validate(w)
    return w


# Byte sizes DLIO reads as a mean (it draws sizes around them and rounds down): published
# files give them with a fraction, which is dropped with a note.
_FRACTIONAL = ("record_length", "record_length_stdev", "record_length_resize")


def _note_fraction(w: Workload, key: str, value: Any) -> None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return  # a size such as 8MiB: whole
    if not number.is_integer():
        w.notes.append(f"{key} {_show(value)} is read as {int(number)} bytes (rounded down, "
                       "as DLIO does)")


def _note_no_effect(doc: dict[str, Any], w: Workload) -> None:
    for (section, key), why in sorted(NO_EFFECT.items()):
        body = doc.get(section)
        if isinstance(body, dict) and key in body:
            w.notes.append(f"{section}.{key} has no effect"
                           + (f": {why}" if why else " on the emulated I/O"))


def _record_length_of(doc: dict[str, Any], source: str) -> int:
    """The file's own record length (before overrides), 0 when unset or unreadable."""
    body = doc.get("dataset")
    if not isinstance(body, dict):
        return 0
    for key in ("record_length_bytes", "record_length"):
        if body.get(key) is not None:
            try:
                return int(_number(f"dataset.{key}", body[key], int, 1, 1 << 36, source,
                                   fraction=True))
            except ConfigError:
                return 0  # reported when the whole file is parsed
    return 0


def _scale_spread(w: Workload, file_length: int, overridden: set[tuple[str, ...]]) -> None:
    """A ``--set`` record length without a ``--set`` spread keeps the spread's proportion."""
    lengths = {("dataset", "record_length"), ("dataset", "record_length_bytes")}
    spreads = {("dataset", "record_length_stdev"), ("dataset", "record_length_bytes_stdev")}
    if (not overridden & lengths or overridden & spreads or w.record_length_stdev <= 0
            or file_length <= 0 or file_length == w.record_length):
        return
    old = w.record_length_stdev
    w.record_length_stdev = round(old * w.record_length / file_length)
    w.notes.append(f"dataset.record_length_bytes_stdev scaled with the overridden "
                   f"record_length_bytes: {old} -> {w.record_length_stdev} (the same spread "
                   f"relative to the size; --set dataset.record_length_bytes_stdev=N to choose)")


def _parse_model(w: Workload, doc: dict[str, Any], model: dict[str, Any], source: str,
                 set_str: _Set) -> None:
    framework = doc.get("framework")
    w.framework = w.framework if framework is None else _as_str("framework", framework, source)
    if w.framework not in LOADERS:
        raise _err(source, f"framework '{w.framework}' is not supported; use pytorch or "
                   "tensorflow (both are emulated the same way: I/O plus a sleep)")
    set_str("model_name", "model", "name")
    set_str("model_type", "model", "type")
    for attr in ("model_datatype", "optimizer_datatype"):
        set_str(attr, "model", attr)
        set_str(attr, "checkpoint", attr)
        if getattr(w, attr) not in DTYPE_BYTES:
            raise _err(source, f"'{attr}' = {_show(getattr(w, attr))}; use one of "
                       f"{', '.join(DTYPE_BYTES)}")
    for key in ("layer_parameters", "optimization_groups"):
        if model.get(key) is not None:
            setattr(w, key, _int_list(f"model.{key}", model[key], source))


def _parse_dataset(w: Workload, get: _Get, set_str: _Set, set_bool: _Set, source: str) -> None:
    set_str("data_folder", "dataset", "data_folder")
    set_str("format", "dataset", "format")
    set_str("file_prefix", "dataset", "file_prefix")
    set_bool("keep_files", "dataset", "keep_files")
    comp = get("dataset", "compression")
    if comp not in (None, "none"):
        raise _err(source, f"'dataset.compression' = {_show(comp)} is not supported; use none")
    if w.format in DLIO_ONLY_FORMATS:
        raise _err(source, f"'dataset.format' = {w.format!r} is a DLIO format this emulator "
                   f"does not implement; use one of {', '.join(FORMATS)}")
    if w.format not in FORMATS:
        raise _err(source, f"'dataset.format' = {_show(w.format)} is unknown; use one of "
                   f"{', '.join(FORMATS)}")


def _parse_reader(w: Workload, get: _Get, set_str: _Set, set_bool: _Set, source: str) -> None:
    loader = get("reader", "data_loader")
    if loader is not None:
        loader = _as_str("reader.data_loader", loader, source)
        if loader not in LOADERS:
            known = " (a DLIO loader this emulator does not implement)" \
                if loader in DLIO_ONLY_LOADERS else ""
            raise _err(source, f"'reader.data_loader' = {_show(loader)}{known} is not "
                       "supported; use pytorch or tensorflow")
        if loader != w.framework:  # DLIO's validate() refuses the mix too
            raise _err(source, f"'reader.data_loader' = {loader} does not go with framework "
                       f"{w.framework} (DLIO refuses the mix); use the same for both")
        if loader == "pytorch" and w.format == "tfrecord":
            raise _err(source, "tfrecord needs reader.data_loader: tensorflow (DLIO has no "
                       "PyTorch reader for it)")
    # DLIO's default loader, the string 'tensorflow', matches no loader of its factory, so a
    # file without reader.data_loader fails there; here it means the framework's loader.
    w.data_loader = loader or w.framework
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
    if w.data_loader == "pytorch" and (w.file_shuffle != "off" or w.sample_shuffle != "off"):
        w.notes.append("reader.file_shuffle and sample_shuffle do not change the order with "
                       "the PyTorch loader (DLIO reads each rank's block of samples in "
                       "ascending order); `lcache bench run --order shuffle` shuffles")
    if w.do_eval and (w.num_files_eval < 1 or w.batch_size_eval < 1):
        raise _err(source, "workflow.evaluation is on: set dataset.num_files_eval and "
                   "reader.batch_size_eval to 1 or more")


def _parse_checkpoint(w: Workload, get: _Get, set_str: _Set, set_bool: _Set,
                      source: str) -> None:
    set_str("checkpoint_folder", "checkpoint", "checkpoint_folder")
    set_bool("checkpoint_fsync", "checkpoint", "fsync")
    set_str("checkpoint_type", "checkpoint", "type")
    if w.checkpoint_type not in ("all_ranks", "rank_zero"):
        raise _err(source, f"'checkpoint.type' = {_show(w.checkpoint_type)}; use all_ranks "
                   "or rank_zero")
    set_str("checkpoint_mode", "checkpoint", "mode")
    if w.checkpoint_mode not in ("default", "subset"):
        raise _err(source, f"'checkpoint.mode' = {_show(w.checkpoint_mode)}; use default or "
                   "subset")
    # DLIO's validate() (utils/config.py): the data-parallel width is the run's own unless a
    # subset of a larger job is checkpointed.
    if w.checkpoint_mode == "subset" and w.data_parallelism <= 0:
        raise _err(source, "checkpoint.mode: subset needs model.parallelism.data, the data-"
                   "parallel width of the whole job (MLPerf: 8 for llama3_70b, 2 for 405b and "
                   "1t)")
    if w.checkpoint_mode == "default" and w.data_parallelism > 0:
        raise _err(source, "model.parallelism.data is for checkpoint.mode: subset (DLIO "
                   "refuses it otherwise: the run's rank count sets it)")
    if w.num_checkpoints_write > 0 and w.num_checkpoints_read > w.num_checkpoints_write:
        raise _err(source, f"checkpoint.num_checkpoints_read = {w.num_checkpoints_read} is "
                   f"more than num_checkpoints_write = {w.num_checkpoints_write} (DLIO refuses "
                   "it: each read loads a checkpoint written before)")
    if w.do_checkpoint and w.do_train and max(w.num_checkpoints_write,
                                              w.num_checkpoints_read) > 0:
        w.notes.append("checkpoint.num_checkpoints_write and num_checkpoints_read have no "
                       "effect with workflow.train on: DLIO uses them only in a checkpoint-"
                       "only run; training checkpoints by epoch or by step")
    if w.do_checkpoint and not w.do_train and max(w.num_checkpoints_write,
                                                  w.num_checkpoints_read) <= 0:
        raise _err(source, "a checkpoint-only run (workflow.train off) with neither "
                   "checkpoint.num_checkpoints_write nor num_checkpoints_read set does "
                   "nothing; set them")


def _parse_storage(w: Workload, sec: dict[str, Any], get: _Get, set_str: _Set,
                   source: str) -> None:
    set_str("storage_type", "storage", "storage_type")
    set_str("storage_root", "storage", "storage_root")
    if w.storage_type not in ("local_fs", "s3"):
        raise _err(source, f"'storage.storage_type' = {_show(w.storage_type)} is not "
                   "supported; use local_fs or s3")
    options = sec.get("storage", {}).get("storage_options") or {}
    for key, value in options.items():
        if key == "s3_force_path_style":
            w.storage_options[key] = _as_bool(f"storage.storage_options.{key}", value, source)
        elif key != "s3_max_attempts":
            w.storage_options[key] = _as_str(f"storage.storage_options.{key}", value, source)
    if not w.on_s3:
        if options:
            w.notes.append("storage.storage_options has no effect with storage_type local_fs")
        if w.storage_root:  # DLIO's FileStorage puts the data folder under it
            w.data_folder = os.path.join(w.storage_root, w.data_folder)
        return
    if not w.data_folder.startswith("s3://"):
        if not w.storage_root:
            raise _err(source, "storage_type s3 needs dataset.data_folder s3://BUCKET/... "
                       "or storage.storage_root BUCKET")
        w.data_folder = f"s3://{w.storage_root}/{w.data_folder.removeprefix('./')}".rstrip("/")
    if w.format not in ("npz", "npy"):
        raise _err(source, f"'dataset.format' = {w.format} on S3: DLIO and lcache read npz "
                   "and npy from S3; use one of them")
    if w.do_checkpoint:
        raise _err(source, "checkpoints on S3 are not emulated; set workflow.checkpoint: "
                   "False (the published S3 workloads do)")


def _validate(w: Workload) -> None:
    src = w.source
    if w.au <= 0:
        raise _err(src, f"metric.au = {w.au} must be a fraction in (0, 1], e.g. 0.90")
    if w.do_checkpoint and w.model_size <= 0 and w.num_layers <= 0 \
            and not w.layer_parameters and not w.optimization_groups:
        raise _err(src, "workflow.checkpoint is on but the checkpoint has no size: set "
                   "model.model_size_bytes or model.num_layers with model.transformer")
    if 0 < w.num_layers < w.pipeline_parallelism:
        raise _err(src, f"model.num_layers {w.num_layers} is smaller than "
                   f"model.parallelism.pipeline {w.pipeline_parallelism} (DLIO refuses it)")
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
        pauses = max(0, w.num_checkpoints_write) + max(0, w.num_checkpoints_read)
        seconds += pauses * max(0.0, w.time_between_checkpoints)
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
