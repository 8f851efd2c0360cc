"""`lcache bench run` on bad input: exit status 2 and one line on stderr, never a traceback, a
hang or a runaway allocation (YAML aliases and tags, wrong types, numbers out of range, totals
this machine cannot hold, a directory or a device as the workload, a folder that cannot hold
files). The ranges still hold every published DLIO and MLPerf Storage workload."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from lcache.bench import BenchOptions, datagen, load_workload, parse_workload, run_workload
from lcache.bench.config import resolve_config, shipped_configs
from lcache.errors import ConfigError, StorePermissionError

from .conftest import assert_one_line_error, mounted_tmpfs, run_lcache

MIB = 1 << 20


def tiny(tmp: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "model": {"name": "tiny"},
        "workflow": {"generate_data": True, "train": True},
        "dataset": {"data_folder": str(tmp / "data"), "format": "npz", "num_files_train": 4,
                    "num_samples_per_file": 1, "record_length_bytes": 4096},
        "reader": {"batch_size": 1, "read_threads": 1},
        "train": {"epochs": 1, "computation_time": 0.0},
        "checkpoint": {"checkpoint_folder": str(tmp / "ckpt")},
        "output": {"folder": str(tmp / "out")},
    }
    for name, body in sections.items():
        doc.setdefault(name, {}).update(body)
    return doc


# "Billion laughs": 9^9 strings from a few lines, under a key DLIO accepts; printing or
# comparing train.epochs expanded it (the old code hung).
BOMB = "\n".join(
    ["profiling:", "  iostat_devices:", "    - &a [" + ", ".join(["lol"] * 9) + "]"]
    + [f"    - &{chr(97 + i)} [" + ", ".join(["*" + chr(96 + i)] * 9) + "]" for i in range(1, 9)]
    + ["train: {epochs: *i}"]) + "\n"


@pytest.mark.parametrize(("text", "words"), [
    (BOMB, ["aliases (*name) are not allowed"]),
    ("train: {epochs: 1e12}\n", ["train.epochs must be an integer in 1..1000000, got 1e12"]),
    ("dataset: {num_files_train: 1e12}\n",
     ["dataset.num_files_train must be an integer in 1..16777216, got 1e12"]),
    ("dataset: {record_length_bytes: .inf}\n", ["record_length_bytes must be an integer", "inf"]),
    ("dataset: {record_length_bytes: .nan}\n", ["record_length_bytes must be an integer", "nan"]),
    ("dataset: {record_length_bytes: 1e18}\n", ["record_length_bytes must be an integer in 1..",
                                                "got 1e18"]),
    ("dataset: {record_length_bytes_stdev: -1}\n", ["record_length_bytes_stdev must be", "0.."]),
    ("train: {computation_time_stdev: -0.5}\n", ["train.computation_time_stdev must be a number "
                                                 "in 0..3600, got -0.5"]),
    ("reader: {transfer_size: -1}\n", ["reader.transfer_size must be an integer in 0.."]),
    ("reader: {prefetch_size: -1}\n", ["reader.prefetch_size must be an integer in 0..1024"]),
    ("reader: {read_threads: 100000}\n", ["reader.read_threads must be an integer in 0..256, "
                                          "got 100000"]),
    ("model: {parallelism: {tensor: x}}\n", ["model.parallelism.tensor must be an integer"]),
    ("model: {parallelism: {tensor: 0}}\n", ["model.parallelism.tensor must be an integer in 1.."]),
    ("workflow: {profiling: maybe}\n", ["workflow.profiling must be a boolean"]),
    ("train: {seed: -1}\n", ["train.seed must be an integer in 0.."]),
    ("dataset: {data_folder: \"a\\0b\"}\n", ["dataset.data_folder must be a string", "NUL"]),
    ("train: {epochs: " + "9" * 5000 + "}\n", ["not valid YAML for a workload"]),
    ("train: {epochs: 2001-02-30}\n", ["not valid YAML for a workload"]),
    ("a: " + "[" * 5000 + "]" * 5000 + "\n", ["nested deeper than 16 levels"]),
    ("train: !!python/object/apply:os.system [true]\n", ["the tag !!python/object/apply:os.system"
                                                         " is not allowed"]),
    ("train: {epochs: 3, epochs: 1}\n", ["line 1, column 20: the key 'epochs' is given twice"]),
    # a fraction was dropped: 1.5 epochs ran 1, exit 0, no note
    ("train: {epochs: 1.5}\n", ["train.epochs must be a whole number, got 1.5"]),
    ("reader: {batch_size: '2.5'}\n", ["reader.batch_size must be a whole number, got 2.5"]),
    ("model: {layer_parameters: [1, 2.5]}\n",
     ["model.layer_parameters[1] must be a whole number, got 2.5"]),
])
def test_bad_workload_file_is_one_line(tmp_path: Path, text: str, words: list[str]) -> None:
    path = tmp_path / "w.yaml"
    path.write_text(text)
    assert_one_line_error(run_lcache("bench", "run", str(path), cwd=tmp_path), "w.yaml", *words)


@pytest.mark.parametrize(("override", "words"), [
    ('train.epochs=!!python/object/apply:os.system ["true"]',
     ["--set train.epochs", "the tag !!python/object/apply:os.system is not allowed"]),
    ("train.epochs=[1", ["--set train.epochs: not valid YAML for a workload"]),
    ("train.epochs=*a", ["--set train.epochs", "alias"]),
    ("dataset.record_length_bytes=.inf", ["record_length_bytes must be an integer"]),
])
def test_bad_set_value_is_one_line(tmp_path: Path, override: str, words: list[str]) -> None:
    run = run_lcache("bench", "run", "unet3d_h100", "--set", override, cwd=tmp_path)
    assert_one_line_error(run, *words)


@pytest.mark.parametrize("overrides", ["train.epochs=1", b"train.epochs=1", None,
                                       ["train.epochs=1", 2], {"train.epochs": 1}])
def test_overrides_not_a_list_of_strings_are_named(tmp_path: Path, overrides: Any) -> None:
    """The finding (attack helper 87): parse_workload(doc, overrides="a.b=1") walked the str
    a character at a time: "override 'a' is not SECTION.KEY=VALUE"."""
    with pytest.raises(ConfigError, match=r"^overrides=.*: give a list of SECTION\.KEY=VALUE"):
        parse_workload(tiny(tmp_path), overrides=overrides)


def test_model_set_tag_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(tiny(tmp_path)))
    run = run_lcache("bench", "run", str(path), "--offload-from", "bert-large", "--model-set",
                 "gpus=!!python/name:os.system", cwd=tmp_path)
    assert_one_line_error(run, "--model-set gpus", "the tag !!python/name:os.system")


@pytest.mark.parametrize("option", [("--model-set", "foo=1"), ("--max-step-bytes", "garbage"),
                                    ("--max-step-bytes", "1GiB")])
def test_offload_options_without_offload_from_are_refused(tmp_path: Path,
                                                          option: tuple[str, str]) -> None:
    """The finding (attack helper 69, finding 8): read only with --offload-from, both were
    accepted without it, never checked (an unknown setting, a size that is none), and the
    run went ahead as if they had not been given."""
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(tiny(tmp_path)))
    run = run_lcache("bench", "run", str(path), *option, cwd=tmp_path)
    assert_one_line_error(run, option[0], "--offload-from")
    assert not (tmp_path / "data").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("duration", ["nan", "inf", "-1"])
def test_from_model_duration_is_a_positive_number(tmp_path: Path, duration: str) -> None:
    run = run_lcache("bench", "from-model", "bert-large", "--duration", duration, "--dir",
                 str(tmp_path), cwd=tmp_path)
    assert_one_line_error(run, f"--duration {float(duration)} must be a positive number")


def test_directory_device_and_fifo_are_not_workloads(tmp_path: Path) -> None:
    (tmp_path / "cfg").mkdir()
    assert_one_line_error(run_lcache("bench", "run", "cfg", cwd=tmp_path), "cfg is a directory")
    assert_one_line_error(run_lcache("bench", "run", "/dev/zero", cwd=tmp_path),
                          "/dev/zero is not a regular file")
    os.mkfifo(tmp_path / "fifo")  # opening it for reading would wait for a writer forever
    assert_one_line_error(run_lcache("bench", "run", "fifo", cwd=tmp_path),
                          "fifo is not a regular file")
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * 200_000)
    assert_one_line_error(run_lcache("bench", "run", str(big), cwd=tmp_path), "over 1 MiB")


def test_checkpoint_folder_that_cannot_hold_files(tmp_path: Path) -> None:
    doc = tiny(tmp_path, workflow={"train": False, "checkpoint": True},
               model={"model_size_bytes": 4096}, checkpoint={"checkpoint_folder": "/proc/self",
                                                       "num_checkpoints_write": 1})
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert_one_line_error(run_lcache("bench", "run", str(path), cwd=tmp_path), "/proc/self")
    with pytest.raises(StorePermissionError, match="/proc/self is not writable"):
        run_workload(load_workload(str(path)), BenchOptions(show_progress=False))


def test_a_dataset_folder_on_a_virtual_filesystem_is_said_to_hold_no_files(
        tmp_path: Path) -> None:
    """The finding (attack helper 69, finding 10): a dataset folder under /proc was refused as
    "needs about 48.1 KiB in /proc/self/data, which has 0 B free; ... or free some space":
    there is no space to free there; the filesystem holds no files at all."""
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(tiny(tmp_path, dataset={"data_folder": "/proc/self/data"})))
    err = assert_one_line_error(run_lcache("bench", "run", str(path), cwd=tmp_path),
                                "/proc/self/data", "has no room for files at all")
    assert "free some space" not in err, err


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_data_file_that_is_not_a_file_is_named(tmp_path: Path, kind: str) -> None:
    """Regression: a directory in place of a data file was "error: Is a directory", naming
    nothing; a FIFO would have blocked the reader."""
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(tiny(tmp_path)))
    run_workload(load_workload(str(path)), BenchOptions(show_progress=False))
    victim = next((tmp_path / "data" / "train").glob("*.npz"))
    victim.unlink()
    if kind == "fifo":
        os.mkfifo(victim)
    else:
        victim.mkdir()
    shown = "a FIFO" if kind == "fifo" else "a directory"
    assert_one_line_error(run_lcache("bench", "run", str(path), "--no-generate", cwd=tmp_path),
                          f"{victim} is {shown}, not a data file of this workload")


# --------------------------------------------------------------------------- published values
# The largest value of each field in any published DLIO workload (argonne-lcf/dlio_benchmark
# configs/workload, whole history) or MLPerf Storage v1.0/v2.0 workload (mlcommons/storage
# configs/dlio/workload), applied to a shipped config of the same kind.
PUBLISHED = [
    ("unet3d_h100", ["dataset.num_files_train=1281167"]),
    ("unet3d_h100", ["dataset.num_files_train=1", "dataset.num_samples_per_file=4195198976"]),
    ("unet3d_h100", ["dataset.record_length_bytes=671088640",
                     "dataset.record_length_bytes_stdev=109346892",
                     "dataset.record_length_bytes_resize=2097152"]),
    ("unet3d_h100", ["reader.batch_size=2048", "reader.batch_size_eval=16384",
                     "reader.read_threads=8", "reader.prefetch_size=0",
                     "reader.transfer_size=262144", "reader.computation_threads=8"]),
    ("unet3d_h100", ["train.epochs=311541", "train.total_training_steps=311541",
                     "train.computation_time=8.99"]),
    ("unet3d_h100", ["train.computation_time=0.000770031", "metric.au=0.70"]),
    ("unet3d_h100", ["workflow.evaluation=true", "dataset.num_files_eval=65536",
                     "evaluation.eval_time=11.572", "evaluation.eval_after_epoch=5",
                     "evaluation.epochs_between_evals=0"]),
    ("unet3d_h100", ["workflow.checkpoint=true", "checkpoint.checkpoint_after_epoch=1000",
                     "checkpoint.epochs_between_checkpoints=1000",
                     "checkpoint.steps_between_checkpoints=1250",
                     "model.model_size_bytes=4034713312"]),
    ("llama3_405b", ["model.num_layers=128", "model.transformer.hidden_size=25872",
                     "model.transformer.ffn_hidden_size=98304",
                     "model.transformer.num_attention_heads=192",
                     "model.transformer.num_kv_heads=32", "model.parallelism.pipeline=64",
                     "model.parallelism.zero_stage=-1"]),
]


@pytest.mark.parametrize(("base", "overrides"), PUBLISHED)
def test_published_values_are_within_the_ranges(base: str, overrides: list[str]) -> None:
    w = load_workload(resolve_config(base), overrides)
    for item in overrides:
        key, _, value = item.rpartition(".")[2].partition("=")
        attr = {"record_length_bytes": "record_length",
                "record_length_bytes_stdev": "record_length_stdev",
                "record_length_bytes_resize": "record_length_resize",
                "model_size_bytes": "model_size",
                "tensor": "tensor_parallelism", "pipeline": "pipeline_parallelism",
                "evaluation": "do_eval", "checkpoint": "do_checkpoint"}.get(key, key)
        if hasattr(w, attr):
            assert getattr(w, attr) == yaml.safe_load(value), item


def test_shipped_configs_all_validate() -> None:
    for name, path in shipped_configs().items():
        w = load_workload(path)
        assert w.source == path, name


def test_whole_numbers_may_have_a_zero_fraction_and_record_lengths_any(tmp_path: Path
                                                                        ) -> None:
    w = parse_workload(tiny(tmp_path, train={"epochs": 2.0}, reader={"batch_size": "1e0"}))
    assert (w.epochs, w.batch_size, w.notes) == (2, 1, [])
    # DLIO reads record lengths as means and rounds down (MLPerf's resnet50: 114660.07): the
    # fraction is dropped, and the notes say so
    w = parse_workload(tiny(tmp_path, dataset={"record_length_bytes": 4096.7}))
    assert w.record_length == 4096
    assert w.notes == ["dataset.record_length_bytes 4096.7 is read as 4096 bytes (rounded "
                       "down, as DLIO does)"]


def test_totals_are_bounded_at_parse_time(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"= 68719476736 samples; at most 4294967296 per epoch"):
        parse_workload(tiny(tmp_path, dataset={"num_files_train": 1 << 24,
                                               "num_samples_per_file": 1 << 12}))
    # a checkpoint-only run of 10,000 checkpoints a day apart would last 27 years
    with pytest.raises(ConfigError, match=r"sleep 10,000 days .* more than 31 days"):
        parse_workload(tiny(tmp_path, workflow={"train": False, "checkpoint": True},
                            model={"model_size_bytes": 1},
                            checkpoint={"num_checkpoints_write": 10_000,
                                        "time_between_checkpoints": 86_400}))


# --------------------------------------------------------------------------- this machine
# A regression in these checks must not fill the disk or the memory of the machine running
# the tests: nothing here generates data outside a small tmpfs, and the run-length and memory
# cases do not generate at all (their old behaviour was to start generating).
NO_DATA = {"generate_data": False}


def test_runs_longer_than_a_month_or_a_billion_steps_are_refused(tmp_path: Path) -> None:
    long_sleep = tiny(tmp_path, workflow=NO_DATA,
                      train={"epochs": 1000, "computation_time": 3600})
    with pytest.raises(ConfigError, match="sleep 167 days"):
        run_workload(parse_workload(long_sleep), BenchOptions(show_progress=False))
    many = tiny(tmp_path, workflow=NO_DATA, dataset={"num_files_train": 1 << 20},
                train={"epochs": 1_000_000})
    with pytest.raises(ConfigError, match=r"make 1048576000000 steps, more than 1000000000"):
        run_workload(parse_workload(many), BenchOptions(show_progress=False))


def test_epoch_larger_than_memory_is_refused(tmp_path: Path) -> None:
    doc = tiny(tmp_path, workflow=NO_DATA,
               dataset={"format": "tfrecord", "num_files_train": 1 << 16,
                        "num_samples_per_file": 1 << 16},
               reader={"read_threads": 256, "batch_size": 1 << 20})
    with pytest.raises(ConfigError, match=r"an epoch of 4294967296 samples needs about .* of "
                                          "memory"):
        run_workload(parse_workload(doc), BenchOptions(show_progress=False))


def test_a_file_larger_than_memory_is_not_generated(tmp_path: Path) -> None:
    w = parse_workload(tiny(tmp_path, dataset={"num_files_train": 1,
                                               "num_samples_per_file": 1 << 20,
                                               "record_length_bytes": 1 << 36}))
    with pytest.raises(ConfigError, match=r"generating a npz file of 1048576 samples of "
                                          r"68719476736 bytes needs about .* of memory"):
        datagen.generate(w, str(tmp_path / "data"))


def test_files_of_another_workload_are_not_said_to_be_made_again_before_a_refusal(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The finding (attack helper 98): a refused run warned "generating the train files
    again" first, though nothing was written."""
    small = parse_workload(tiny(tmp_path, dataset={"num_files_train": 2}))
    datagen.generate(small, str(tmp_path / "data"))
    before = sorted(p.name for p in (tmp_path / "data" / "train").iterdir())
    huge = parse_workload(tiny(tmp_path, dataset={"num_files_train": 2,
                                                  "num_samples_per_file": 1 << 20,
                                                  "record_length_bytes": 1 << 36}))
    with caplog.at_level(logging.WARNING, logger="lcache"), \
            pytest.raises(ConfigError, match="of memory"):
        datagen.generate(huge, str(tmp_path / "data"))
    assert "again" not in caplog.text, caplog.text
    assert sorted(p.name for p in (tmp_path / "data" / "train").iterdir()) == before


def test_dataset_or_checkpoints_larger_than_the_disk_are_refused(tmp_path: Path) -> None:
    """On a 6 MiB tmpfs: 8 files of 1 MiB, or two checkpoints of 4 MiB, are refused before
    anything is written; 4 files run."""
    with mounted_tmpfs(tmp_path / "fs", "6m") as fs:
        data = fs / "data"
        doc = tiny(tmp_path, dataset={"data_folder": str(data), "num_files_train": 8,
                                      "record_length_bytes": MIB})
        with pytest.raises(ConfigError, match=r"generating the dataset needs about 8\.0 MiB in "
                                              r".*, which has [0-9.]+ MiB free"):
            run_workload(parse_workload(doc), BenchOptions(show_progress=False))
        assert not list(data.rglob("*.npz"))
        doc["dataset"]["num_files_train"] = 4
        s = run_workload(parse_workload(doc), BenchOptions(show_progress=False))
        assert s["per_epoch"][0]["steps"] == 4

        ck = tiny(tmp_path, workflow={"train": False, "checkpoint": True},
                  model={"model_size_bytes": 4 * MIB},
                  checkpoint={"checkpoint_folder": str(fs / "ck"), "num_checkpoints_write": 2})
        with pytest.raises(ConfigError, match=r"2 checkpoint\(s\) of 1 rank\(s\) needs about "
                                              r"8\.0 MiB in .*ck, which has"):
            run_workload(parse_workload(ck), BenchOptions(show_progress=False))
        assert not (fs / "ck").exists()


@pytest.mark.parametrize(("sections", "words"), [
    ({"dataset": {"num_files_train": 1 << 24, "record_length_bytes": "64GiB"}},
     r"generating the dataset needs about"),
    ({"workflow": {"checkpoint": True}, "model": {"model_size_bytes": "1PiB"},
      "checkpoint": {"steps_between_checkpoints": 1}}, r"checkpoint\(s\) of 1 rank\(s\) needs"),
    ({"dataset": {"format": "indexed_binary", "num_files_train": 1,
                  "num_samples_per_file": 1 << 32, "record_length_bytes": 1}},
     r"more than 1000000000"),
])
def test_a_refused_run_leaves_no_folder(tmp_path: Path, sections: dict[str, Any],
                                        words: str) -> None:
    """Refused before anything is written: the data, output and checkpoint folders were made
    first and left behind empty."""
    w = parse_workload(tiny(tmp_path, **sections))
    with pytest.raises(ConfigError, match=words):
        run_workload(w, BenchOptions(show_progress=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_folder_refused_after_another_was_made_takes_it_away(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    doc = tiny(tmp_path, workflow={"checkpoint": True},
               checkpoint={"checkpoint_folder": str(tmp_path / "file" / "ck")},
               output={"folder": str(tmp_path / "out" / "run1")})
    with pytest.raises(ConfigError, match="a parent is not a directory"):
        run_workload(parse_workload(doc), BenchOptions(show_progress=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize(("sections", "words"), [
    ({"reader": {"batch_size": 5}}, r"4 files x 1 samples make no full batch of 5"),
    ({"workflow": {"evaluation": True},
      "dataset": {"num_files_eval": 1}, "reader": {"batch_size_eval": 2}},
     r"1 evaluation files make no full batch of 2"),
])
def test_files_that_make_no_full_batch_are_refused_before_any_is_generated(
        tmp_path: Path, sections: dict[str, Any], words: str) -> None:
    """The check ran after generating the whole dataset (minutes for a large one)."""
    w = parse_workload(tiny(tmp_path, **sections))
    with pytest.raises(ConfigError, match=words):
        run_workload(w, BenchOptions(show_progress=False))
    assert not (tmp_path / "data").exists() or not list((tmp_path / "data").rglob("*.npz"))


def test_a_run_without_generating_refused_for_its_files_leaves_no_folder(
        tmp_path: Path) -> None:
    """The finding (newcomer helper 55): without generate_data, missing files or files that
    make no full batch were refused only after the output and checkpoint folders were made,
    and those were left behind empty."""
    made = tiny(tmp_path, workflow={"generate_data": True, "train": False})
    run_workload(parse_workload(made), BenchOptions(show_progress=False))  # 4 files
    for name in ("out", "ckpt"):
        shutil.rmtree(tmp_path / name, ignore_errors=True)
    for sections, words in (({"dataset": {"num_files_train": 8}}, "holds 4 npz files"),
                            ({"reader": {"batch_size": 5}}, "make no full batch of 5")):
        doc = tiny(tmp_path, workflow={"generate_data": False, "train": True,
                                       "checkpoint": True}, **sections)
        with pytest.raises(ConfigError, match=words):
            run_workload(parse_workload(doc), BenchOptions(show_progress=False))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


@pytest.mark.parametrize(("section", "key", "value"), [
    ("reader", "batch_size", None), ("dataset", "record_length_bytes", None),
    ("dataset", "data_folder", ""), ("checkpoint", "checkpoint_folder", " "),
])
def test_a_key_without_a_value_is_refused(tmp_path: Path, section: str, key: str,
                                          value: Any) -> None:
    # (attack helper 47) `batch_size:` ran with 1, `record_length_bytes: ~` with 65536, and
    # `data_folder: ""` wrote into the current directory
    with pytest.raises(ConfigError, match=f"'{section}.{key}' is given without a value"):
        parse_workload(tiny(tmp_path, **{section: {key: value}}), "w.yaml")
    with pytest.raises(ConfigError, match=f"'{section}.{key}' is given without a value"):
        parse_workload(tiny(tmp_path), "w.yaml", [f"{section}.{key}="])


@pytest.mark.parametrize("workload, opts", [({"a": 1}, None), (None, None),
                                            ("unet3d", None), ("W", {"order": "shuffle"})])
def test_run_workload_names_an_argument_of_the_wrong_kind(workload: Any, opts: Any) -> None:
    # (attack helper 87) a dict was an AttributeError ('dict' object has no attribute 'notes')
    if workload == "W":
        workload = load_workload(shipped_configs()["resnet50_a100"])
    with pytest.raises(ConfigError, match=r"workload|opts="):
        run_workload(workload, opts)
