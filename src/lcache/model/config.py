"""Training configuration: the dataclass, presets with overrides, and YAML model files.

A model file is YAML with the shape's keys at the top level (``layers``, ``hidden``,
``ffn_hidden``, ``heads``, ``kv_heads``, ``vocab``, ``seq_len``, optional flags), or ``preset:``
plus the keys that differ, and an optional ``training:`` mapping of :class:`TrainingConfig`
fields. Unknown keys are refused with an error that names the key and the file.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lcache.checks import path_argument
from lcache.errors import ConfigError
from lcache.model.formulas import RECOMPUTE, dtype_bytes
from lcache.model.hardware import get_gpu
from lcache.model.presets import PRESET_TRAINING, PRESETS, ModelShape, get_preset
from lcache.store.layout import parse_size

PRECISIONS = ("bf16", "fp8")
DEFAULT_CHECKPOINT_MINUTES = 30.0
DAY_S = 86_400.0

# Fields that take a size: YAML and overrides may write "3.84TB" or "7GB" for them.
#: the most each count may be (past these the figures mean nothing, and huge values overflow)
MAX_COUNT = {"gpus": 1_000_000, "global_batch": 1 << 30, "micro_batch": 1 << 20,
              "tp": 1 << 16, "pp": 1 << 16, "gpus_per_node": 1024, "ssds_per_node": 1024,
              "retention": 1_000_000}

_SIZE_FIELDS = ("ssd_capacity_bytes", "ssd_write_bytes_per_s", "ssd_read_bytes_per_s",
                "hbm_bytes")


@dataclass
class TrainingConfig:
    """Everything the I/O model needs about a training run. All sizes in bytes.

    Attributes:
        model: the model's shape (a preset's or a model file's).
        gpus: accelerators in the job.
        gpu: accelerator kind (``h100``, ``h200``, ``a100``), for peak FLOP/s and HBM.
        peak_flops: dense peak FLOP/s per GPU; overrides ``gpu``'s when set.
        hbm_bytes: GPU memory; overrides ``gpu``'s when set.
        mfu: model FLOP utilisation, 0-1 (Llama 3 reached 0.38-0.43).
        global_batch: sequences per optimizer step, all data-parallel ranks together.
        micro_batch: sequences per GPU per forward/backward pass.
        precision: compute precision, ``bf16`` or ``fp8`` (picks the peak FLOP/s).
        weight_dtype: dtype of the weights (and gradients) held and checkpointed.
        master_dtype: dtype of the optimizer's master copy of the weights.
        optimizer_state_dtype: dtype of Adam's m and v.
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        dp: data-parallel size; derived as ``gpus / (tp x pp)`` when ``None``.
        zero_stage: ZeRO stage 0-3 (sharding of optimizer state, gradients, weights over dp).
        recompute: activation recomputation, ``none``, ``selective`` or ``full``.
        sequence_parallel: Megatron sequence parallelism with TP (splits norms/dropout by tp).
        checkpoint_interval_steps: steps between checkpoints (give this or the minutes).
        checkpoint_interval_minutes: minutes between checkpoints (30 when neither is given).
        retention: checkpoints kept on the node's SSDs.
        activation_offload: activations go to SSD in forward and come back in backward.
        optimizer_offload: optimizer state lives on SSD, read and written back every step.
        bytes_per_token: dataset bytes per token on disk; from the vocabulary when ``None``.
        gpus_per_node: accelerators per node.
        ssds_per_node: NVMe drives per node the I/O lands on.
        ssd_capacity_bytes: capacity of one drive.
        ssd_write_bytes_per_s: sustained sequential write bandwidth of one drive.
        ssd_read_bytes_per_s: sustained sequential read bandwidth of one drive.
        ssd_rated_dwpd: drive writes per day the drives are rated for.
        restarts_per_day: job restarts (each reads the latest checkpoint back).
        restart_budget_s: seconds a restart may spend loading the checkpoint.
        max_stall_fraction: share of time the GPUs may wait on I/O that is not overlapped.
    """

    model: ModelShape = field(default_factory=lambda: PRESETS["llama3-8b"])
    gpus: int = 8
    gpu: str = "h100"
    peak_flops: float | None = None
    hbm_bytes: int | None = None
    mfu: float = 0.40
    global_batch: int = 512
    micro_batch: int = 1
    precision: str = "bf16"
    weight_dtype: str = "bf16"
    master_dtype: str = "fp32"
    optimizer_state_dtype: str = "fp32"
    tp: int = 1
    pp: int = 1
    dp: int | None = None
    zero_stage: int = 1
    recompute: str = "selective"
    sequence_parallel: bool = True
    checkpoint_interval_steps: int | None = None
    checkpoint_interval_minutes: float | None = None
    retention: int = 3
    activation_offload: bool = False
    optimizer_offload: bool = False
    bytes_per_token: int | None = None
    gpus_per_node: int = 8
    # A DGX H100 carries 8 x 3.84 TB U.2 NVMe for data; bandwidths and endurance are those of
    # a PCIe Gen4 data-centre drive of that size (Samsung PM1733 3.84 TB datasheet: 7,000 MB/s
    # read, 3,800 MB/s write, 1 DWPD for 5 years).
    ssds_per_node: int = 8
    ssd_capacity_bytes: int = 3_840_000_000_000
    ssd_write_bytes_per_s: float = 3.8e9
    ssd_read_bytes_per_s: float = 7.0e9
    ssd_rated_dwpd: float = 1.0
    restarts_per_day: float = 1.0
    restart_budget_s: float = 300.0
    max_stall_fraction: float = 0.05

    def __post_init__(self) -> None:
        self.validate()

    # -- derived values ------------------------------------------------------------------------

    @property
    def data_parallel(self) -> int:
        """``dp``, or ``gpus / (tp x pp)`` when not given."""
        return self.dp if self.dp is not None else self.gpus // (self.tp * self.pp)

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    @property
    def gpu_peak_flops(self) -> float:
        if self.peak_flops is not None:
            return self.peak_flops
        return get_gpu(self.gpu).peak_flops(self.precision)

    @property
    def gpu_hbm_bytes(self) -> int:
        return self.hbm_bytes if self.hbm_bytes is not None else get_gpu(self.gpu).hbm_bytes

    @property
    def micro_batches_per_step(self) -> int:
        """Forward/backward passes each GPU runs per optimizer step (gradient accumulation)."""
        return self.global_batch // (self.micro_batch * self.data_parallel)

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first setting that cannot work."""
        if not isinstance(self.model, ModelShape):
            raise ConfigError(f"model must be a ModelShape, got {type(self.model).__name__}")
        for fld in dataclasses.fields(self):
            value = getattr(self, fld.name)
            kind = str(fld.type)
            if value is None and "None" in kind:
                continue
            if kind.startswith("bool"):
                ok = isinstance(value, bool)
            elif kind.startswith(("int", "float")):
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
                if ok and not _is_finite(value):
                    # inf passes the range checks below and nan fails none of the `< x`
                    # ones; either (or an int beyond float range) breaks predict()
                    shown = f"an integer of {value.bit_length()} bits" \
                        if isinstance(value, int) else repr(value)
                    raise ConfigError(f"{fld.name} must be a finite number, got {shown}")
            elif kind.startswith("str"):
                ok = isinstance(value, str)
            else:
                continue
            if not ok:
                raise ConfigError(f"{fld.name} must be {kind.replace(' | None', '')}, "
                                  f"got {value!r}")
        for key in ("gpus", "global_batch", "micro_batch", "tp", "pp", "gpus_per_node",
                    "ssds_per_node", "retention"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{key} must be a positive integer, got {value!r}")
            if value > MAX_COUNT[key]:
                raise ConfigError(f"{key} {value:,} is out of range: give 1 to "
                                  f"{MAX_COUNT[key]:,}")
        for key in ("ssd_capacity_bytes", "ssd_write_bytes_per_s", "ssd_read_bytes_per_s",
                    "ssd_rated_dwpd", "restart_budget_s", "max_stall_fraction"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{key} must be > 0, got {getattr(self, key)!r}")
        if self.restarts_per_day < 0:
            raise ConfigError(f"restarts_per_day must be >= 0, got {self.restarts_per_day!r}")
        if not self.max_stall_fraction < 1:
            raise ConfigError(f"max_stall_fraction is a share of time in (0, 1), got "
                              f"{self.max_stall_fraction!r} (write 0.05 for 5%)")
        if self.restarts_per_day * self.restart_budget_s > DAY_S:
            raise ConfigError(f"restarts_per_day x restart_budget_s = {self.restarts_per_day!r}"
                              f" x {self.restart_budget_s!r} s is more than a day ({DAY_S:g} s) "
                              "spent restarting; lower one of them")
        if not 0 < self.mfu <= 1:
            raise ConfigError(f"mfu is a fraction of peak in (0, 1], got {self.mfu!r} "
                              "(write 0.4 for 40%)")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, "
                              f"got {self.precision!r}")
        for key in ("weight_dtype", "master_dtype", "optimizer_state_dtype"):
            dtype_bytes(getattr(self, key))
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE)}, "
                              f"got {self.recompute!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.peak_flops is None:
            self.gpu_peak_flops  # noqa: B018 - raises for an unknown kind or fp8 on A100
        elif not self.peak_flops > 0:
            raise ConfigError(f"peak_flops must be > 0, got {self.peak_flops!r}")
        if self.hbm_bytes is None:
            get_gpu(self.gpu)
        model_parallel = self.tp * self.pp
        if self.dp is None:
            if self.gpus % model_parallel:
                raise ConfigError(f"gpus {self.gpus} is not a multiple of tp x pp = "
                                  f"{self.tp} x {self.pp}; change gpus, tp or pp")
        elif self.dp < 1 or self.dp * model_parallel != self.gpus:
            raise ConfigError(f"tp x pp x dp = {self.tp} x {self.pp} x {self.dp} = "
                              f"{model_parallel * self.dp} but gpus is {self.gpus}; "
                              "they must be equal (or leave dp out to derive it)")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            # per-node figures are the job's divided by whole nodes: a part node would be
            # counted as a full one
            raise ConfigError(f"gpus {self.gpus} is not a multiple of gpus_per_node "
                              f"{self.gpus_per_node} (nodes are counted full); change gpus "
                              "or gpus_per_node")
        if self.global_batch % (self.micro_batch * self.data_parallel):
            raise ConfigError(f"global_batch {self.global_batch} is not a multiple of "
                              f"micro_batch x dp = {self.micro_batch} x {self.data_parallel}")
        if self.model.layers < self.pp:
            raise ConfigError(f"pp {self.pp} is more than the model's {self.model.layers} "
                              "layers")
        if self.model.heads % self.tp:
            raise ConfigError(f"tp {self.tp} does not divide the model's {self.model.heads} "
                              "attention heads")
        steps, minutes = self.checkpoint_interval_steps, self.checkpoint_interval_minutes
        if steps is not None and minutes is not None:
            raise ConfigError("give checkpoint_interval_steps or checkpoint_interval_minutes, "
                              "not both")
        if steps is not None and (not isinstance(steps, int) or steps < 1):
            raise ConfigError(f"checkpoint_interval_steps must be a positive integer, "
                              f"got {steps!r}")
        if minutes is not None and not minutes > 0:
            raise ConfigError(f"checkpoint_interval_minutes must be > 0, got {minutes!r}")
        if self.bytes_per_token is not None and self.bytes_per_token < 1:
            raise ConfigError(f"bytes_per_token must be >= 1, got {self.bytes_per_token!r}")

    def to_dict(self) -> dict[str, Any]:
        doc = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        doc["model"] = self.model.to_dict()
        doc["dp"] = self.data_parallel
        doc["nodes"] = self.nodes
        doc["peak_flops"] = self.gpu_peak_flops
        doc["hbm_bytes"] = self.gpu_hbm_bytes
        return doc


def _is_finite(value: float) -> bool:
    """Whether ``value`` is a finite number; an int too large for a float is not."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


_SHAPE_KEYS = {f.name for f in dataclasses.fields(ModelShape)}
_TRAINING_KEYS = {f.name for f in dataclasses.fields(TrainingConfig)} - {"model"}


def _coerce(key: str, value: Any) -> Any:
    if key in _SIZE_FIELDS and isinstance(value, str):
        return parse_size(value)
    return value


def build_config(shape: ModelShape, training: dict[str, Any], *, where: str = "") -> \
        TrainingConfig:
    """A :class:`TrainingConfig` from a shape, shape overrides and training settings.

    Keys of ``training`` may name a :class:`ModelShape` field (``seq_len``, ``heads``...) or a
    :class:`TrainingConfig` field; anything else is refused.
    """
    shape_changes: dict[str, Any] = {}
    settings: dict[str, Any] = {}
    for key, value in training.items():
        if key in _SHAPE_KEYS and key not in ("source",):
            shape_changes[key] = value
        elif key in _TRAINING_KEYS:
            settings[key] = _coerce(key, value)
        else:
            raise ConfigError(f"unknown setting {key!r}{where}; known settings: "
                              f"{', '.join(sorted(_TRAINING_KEYS | _SHAPE_KEYS - {'source'}))}")
    if shape_changes:
        shape = dataclasses.replace(shape, **shape_changes)
    try:
        return TrainingConfig(model=shape, **settings)
    except TypeError as exc:  # a wrongly typed value reaching arithmetic in validate()
        raise ConfigError(f"bad value{where}: {exc}") from exc


def config_from_preset(name: str, **overrides: Any) -> TrainingConfig:
    """The preset's shape and training defaults, with ``overrides`` applied.

    Args:
        name: a preset (``llama3-8b``, ``llama3-70b``, ``llama3-405b``, ``gpt3-175b``,
            ``bert-large``).
        **overrides: :class:`TrainingConfig` fields (``gpus=16``, ``mfu=0.45``) or shape fields
            (``seq_len=4096``).

    Raises:
        ConfigError: unknown preset or setting, or a combination that cannot work.
    """
    shape = get_preset(name)
    settings = {**PRESET_TRAINING.get(shape.name, {}), **overrides}
    return build_config(shape, settings)


def load_model_file(path: str | Path, **overrides: Any) -> TrainingConfig:
    """Read a YAML model file (see the module docstring) into a :class:`TrainingConfig`.

    Raises:
        ConfigError: the file is missing, not a regular file of at most 1 MiB of plain YAML
            (no tags, no aliases), or has an unknown or invalid key; the message names the key
            and the file.
    """
    # The reader of every YAML file lcache is handed (no aliases, tags, devices; 1 MiB at
    # most); imported here because lcache.bench imports lcache.model.
    from lcache.bench.yamlfile import load_yaml, read_file

    path = Path(path_argument(path, "path"))  # None became TypeError from Path()
    doc = load_yaml(read_file(str(path), "model"), f"model file {path}", "model file")
    if not isinstance(doc, dict):
        raise ConfigError(f"model file {path} must hold a mapping of keys (layers, hidden, "
                          "...), not " + type(doc).__name__)
    where = f" in {path}"
    doc = dict(doc)
    training = doc.pop("training", None) or {}
    if not isinstance(training, dict):
        raise ConfigError(f"'training' in {path} must be a mapping of settings")
    preset = doc.pop("preset", None)
    base: dict[str, Any] = {}
    if preset is not None:
        shape0 = get_preset(str(preset), f" (preset{where})")
        base = shape0.to_dict()
        training = {**PRESET_TRAINING.get(shape0.name, {}), **training}
    for key in doc:
        if key not in _SHAPE_KEYS or key == "source":
            raise ConfigError(f"unknown key {key!r}{where}; a model file takes "
                              f"{', '.join(sorted(_SHAPE_KEYS - {'source'}))}, 'preset' and "
                              "'training'")
    fields = {**base, **doc}
    fields.setdefault("name", path.stem)
    fields["source"] = str(path)
    missing = [k for k in ("layers", "hidden", "ffn_hidden", "heads", "vocab", "seq_len")
               if k not in fields]
    if missing:
        raise ConfigError(f"model file {path} lacks {', '.join(missing)}")
    fields.setdefault("kv_heads", fields["heads"])
    try:
        shape = ModelShape(**fields)
    except ConfigError as exc:
        raise ConfigError(f"{exc}{where}") from None
    except TypeError as exc:
        raise ConfigError(f"bad model{where}: {exc}") from None
    try:
        return build_config(shape, {**training, **overrides}, where=where)
    except ConfigError as exc:
        if where in str(exc):
            raise
        raise ConfigError(f"{exc}{where}") from None
