"""The keys of a DLIO workload file, the range of every number, and the keys without effect.

Keys and defaults are those DLIO reads (argonne-lcf/dlio_benchmark at commit e1919d7b,
``dlio_benchmark/utils/config.py`` ``LoadConfig``), plus the spellings of DLIO 2.0.0 (tag
v2.0.0: ``dataset.record_length``, ``checkpoint.model_size``). One table per question, so the
parser (``config.py``), the fuzz tests and docs/bench.md agree.
"""

from __future__ import annotations

# Formats whose I/O this emulator reproduces (DLIO FormatType values).
FORMATS = ("npz", "npy", "indexed_binary", "mmap_indexed_binary", "tfrecord")
DLIO_ONLY_FORMATS = ("hdf5", "csv", "jpeg", "png", "parquet", "synthetic")
LOADERS = ("pytorch", "tensorflow")  # reader.data_loader values emulated
DLIO_ONLY_LOADERS = ("dali", "native_dali", "synthetic", "custom", "none")

# section -> key -> kind ("v" a value, "d" a nested mapping checked by NESTED, "l" a list of
# integers).
SCHEMA: dict[str, dict[str, str]] = {
    "model": {k: "v" for k in (
        "name", "type", "model_size", "model_size_bytes", "num_layers", "model_datatype",
        "optimizer_datatype")} | {
        "layer_parameters": "l", "optimization_groups": "l",
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
        "type", "mode", "checkpoint_mechanism_classname")},
    "output": {k: "v" for k in ("folder", "log_file", "keep_files")} | {"metric": "d"},
    "metric": {"au": "v"},
    "storage": {k: "v" for k in ("storage_type", "storage_root")} | {"storage_options": "d"},
    "profiling": {k: "v" for k in ("profiler", "iostat_devices")},
}
NESTED = {
    ("model", "parallelism"): ("tensor", "pipeline", "data", "zero_stage"),
    ("model", "transformer"): ("vocab_size", "hidden_size", "ffn_hidden_size",
                               "num_attention_heads", "num_kv_heads"),
    # DLIO reads the metric window here, not under the top-level `metric` (which holds `au`).
    ("output", "metric"): ("exclude_start_steps", "exclude_end_steps"),
    # DLIO's S3 settings (storage/s3_torch_storage.py).
    ("storage", "storage_options"): ("access_key_id", "secret_access_key", "endpoint_url",
                                     "region", "s3_force_path_style", "s3_max_attempts"),
}
TOP = set(SCHEMA) | {"framework"}

# Keys a user may put where DLIO does not read them: refused with the key DLIO reads.
MISPLACED = {
    ("train", "epoch"): "train.epochs",
    ("metric", "exclude_start_steps"): "output.metric.exclude_start_steps",
    ("metric", "exclude_end_steps"): "output.metric.exclude_end_steps",
}

# Accepted (DLIO files carry them) but without effect on an emulation of the I/O: they tune a
# real framework's compute or DLIO's own bookkeeping. Listed in the run's notes.
NO_EFFECT = {
    ("reader", "computation_threads"): "",
    ("reader", "pin_memory"): "",
    ("reader", "multiprocessing_context"): "",
    ("reader", "data_loader_sampler"): "",
    ("reader", "dont_use_mmap"): "",
    ("dataset", "record_length_resize"): "",
    ("dataset", "record_length_bytes_resize"): "",
    ("dataset", "enable_chunking"): "",
    ("dataset", "chunk_size"): "",
    ("dataset", "keep_files"): "",
    ("checkpoint", "checkpoint_mechanism_classname"): "",
    ("output", "log_file"): "",
    ("output", "keep_files"): "",
    ("workflow", "debug"): "",
    ("profiling", "profiler"): "",
    ("profiling", "iostat_devices"): "",
    # DLIO reads the checkpoint's model size from model.model_size_bytes (2.0.0:
    # checkpoint.model_size); model.model_size, which MLPerf's unet3d files set, is read by
    # no DLIO version, so DLIO writes its 10,240-byte default there.
    ("model", "model_size"): "DLIO reads model.model_size_bytes (default 10240 bytes)",
}

# Bytes per element of the DLIO datatypes (model_datatype / optimizer_datatype).
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "fp64": 8, "int8": 1, "uint8": 1, "fp8": 1}

# Attributes counted in bytes: a --set value may also be a size such as 8MiB.
BYTE_ATTRS = ("record_length", "record_length_stdev", "record_length_resize", "model_size",
              "transfer_size")

# Every number a workload holds, with its range: (attribute, DLIO key, type, min, max). The
# key's "|" gives DLIO's other spelling (same section). The ranges hold every published DLIO
# (argonne-lcf/dlio_benchmark configs/workload, all versions) and MLPerf Storage v1.0/v2.0
# workload, whose largest values are: 1,281,167 files, 4,195,198,976 samples per file (an old
# dlrm), 640 MiB records, batch 2,048 (16,384 for evaluation), 8 read threads, 311,541 epochs,
# 8.99 s of compute per step, 128 layers, hidden 25,872, tensor 8 x pipeline 64. Beyond them
# they stop values that would allocate or run without end (``read_threads: 100000``,
# ``epochs: 1e12``), and negatives where only a sentinel -1 means something.
RANGES: tuple[tuple[str, str, type, int, int], ...] = (
    ("model_size", "model.model_size_bytes", int, 0, 1 << 50),
    ("model_size", "checkpoint.model_size", int, 0, 1 << 50),  # DLIO 2.0.0's place for it
    ("num_layers", "model.num_layers", int, 0, 10_000),
    ("tensor_parallelism", "model.parallelism.tensor", int, 1, 4096),
    ("pipeline_parallelism", "model.parallelism.pipeline", int, 1, 4096),
    ("data_parallelism", "model.parallelism.data", int, 0, 1 << 20),
    ("zero_stage", "model.parallelism.zero_stage", int, -1, 3),
    ("vocab_size", "model.transformer.vocab_size", int, 0, 1 << 24),
    ("hidden_size", "model.transformer.hidden_size", int, 0, 1 << 20),
    ("ffn_hidden_size", "model.transformer.ffn_hidden_size", int, 0, 1 << 22),
    ("num_attention_heads", "model.transformer.num_attention_heads", int, 1, 1 << 16),
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
    ("num_subfolders_eval", "dataset.num_subfolders_eval", int, 0, 1 << 20),
    ("batch_size", "reader.batch_size", int, 1, 1 << 20),
    ("batch_size_eval", "reader.batch_size_eval", int, 1, 1 << 20),
    ("read_threads", "reader.read_threads", int, 0, 256),
    ("prefetch_size", "reader.prefetch_size", int, 0, 1024),
    ("shuffle_size", "reader.shuffle_size", int, 1, 1 << 24),
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
    ("exclude_start_steps", "output.metric.exclude_start_steps", int, 0, 1 << 40),
    ("exclude_end_steps", "output.metric.exclude_end_steps", int, 0, 1 << 40),
    ("s3_max_attempts", "storage.storage_options.s3_max_attempts", int, 1, 100),
)

# DLIO's legacy tensor lists (model.layer_parameters, optimization_groups): elements per entry
# and entries per list.
LIST_MAX_VALUE = 1 << 40
LIST_MAX_LEN = 1024

#: Totals: samples of one epoch (its order is an array in memory), steps of a whole run, and
#: the time a run spends in its emulated compute and checkpoint pauses.
MAX_EPOCH_SAMPLES = 1 << 32
MAX_RUN_STEPS = 10**9
MAX_RUN_S = 31 * 86_400
