"""lcache bench against DLIO's semantics (issue 13): the workflows DLIO runs for a file, how
each checkpoint event is reported, the verdict when nothing was measured, and the figures a
storage engineer reads side by side. Published files come from tests/data/dlio."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from lcache.bench import BenchOptions, load_workload, run_workload
from lcache.bench.config import shipped_configs
from lcache.bench.metrics import RankRecorder, aggregate, verdict
from lcache.errors import ConfigError

DATA = Path(__file__).parent / "data" / "dlio"
MLPERF = DATA / "mlperf_storage"
DLIO = DATA / "dlio_benchmark"
# A transformer small enough for a test: a few MiB of checkpoint.
TINY_LLM = ["model.num_layers=2", "model.transformer.hidden_size=64",
            "model.transformer.ffn_hidden_size=128", "model.transformer.vocab_size=256",
            "model.transformer.num_attention_heads=4", "model.transformer.num_kv_heads=2"]


def folders(tmp: Path) -> list[str]:
    return [f"dataset.data_folder={tmp / 'data'}", f"checkpoint.checkpoint_folder={tmp / 'ck'}",
            f"output.folder={tmp / 'out'}"]


def run(w: Any, **opts: Any) -> dict[str, Any]:
    return run_workload(w, BenchOptions(show_progress=False, **opts))


# --------------------------------------------------------------------------- bug 1
def test_generate_only_workflow_generates_and_says_what(tmp_path: Path) -> None:
    """MLPerf's *_datagen files (generate_data on, train off) generate the dataset."""
    w = load_workload(str(MLPERF / "unet3d_datagen.yaml"), [
        *folders(tmp_path), "dataset.num_files_train=4", "dataset.record_length_bytes=4096",
        "dataset.record_length_bytes_stdev=0"])
    s = run(w)
    files = sorted((tmp_path / "data" / "train").iterdir())
    assert [p.name for p in files] == [f"img_{i}_of_4.npz" for i in range(4)]
    assert s["generated"] == {"files": 4, "bytes": sum(p.stat().st_size for p in files)}
    assert "generated 4 files" in s["verdict"] and "nothing was measured" not in s["verdict"]


# --------------------------------------------------------------------------- bug 2
def test_more_reads_than_writes_is_refused_as_dlio_does(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"num_checkpoints_read = 3 .* num_checkpoints_write"
                                          r" = 1"):
        load_workload(str(MLPERF / "llama3_8b.yaml"), [
            *TINY_LLM, "checkpoint.num_checkpoints_write=1",
            "checkpoint.num_checkpoints_read=3"])


def test_a_read_only_run_without_its_checkpoints_is_refused_before_a_folder_is_made(
        tmp_path: Path) -> None:
    """The finding (attack helper 87): `bench run llama3_8b --checkpoint-dir ck --set
    checkpoint.num_checkpoints_write=0` made output/ and ck/, then refused the missing
    checkpoints and left them empty."""
    def workload(writes: int, reads: int) -> Any:
        return load_workload(str(MLPERF / "llama3_8b.yaml"), [
            *TINY_LLM, *folders(tmp_path), f"checkpoint.num_checkpoints_write={writes}",
            f"checkpoint.num_checkpoints_read={reads}", "checkpoint.time_between_checkpoints=0"])

    with pytest.raises(ConfigError, match="one is missing: global_epoch1_step1/"):
        run(workload(0, 2))
    assert os.listdir(tmp_path) == []
    run(workload(2, 0))  # written by an earlier run, they are read
    s = run(workload(0, 2))
    assert [(c["kind"], c["name"]) for c in s["checkpoints"]] == [
        ("load", "global_epoch1_step1"), ("load", "global_epoch1_step2")]


def test_each_checkpoint_event_is_its_own_row() -> None:
    """Two loads of one checkpoint are two rows, not one row of twice the bytes."""
    ranks = [{"rank": r, "epochs": {}, "evals": {}, "checkpoints": [
        {"kind": "save", "name": "a", "duration_s": 1.0, "rank_duration_s": 0.5, "bytes": 10},
        {"kind": "load", "name": "a", "duration_s": 2.0, "rank_duration_s": 1.0, "bytes": 10},
        {"kind": "load", "name": "a", "duration_s": 4.0, "rank_duration_s": 3.0, "bytes": 10},
    ]} for r in range(2)]
    agg = aggregate(ranks, 1, 0.9, 20)
    loads = [c for c in agg["checkpoints"] if c["kind"] == "load"]
    assert [(c["bytes"], c["duration_s"]) for c in loads] == [(20, 2.0), (20, 4.0)]
    assert agg["metric"]["load_checkpoint_duration_mean_seconds"] == pytest.approx(3.0)


# --------------------------------------------------------------------------- bug 3
def test_num_checkpoints_only_apply_to_checkpoint_only_runs(tmp_path: Path) -> None:
    """DLIO's llama_1t trains (workflow.train: True): DLIO checkpoints after the epoch and
    ignores num_checkpoints_write/read, which only a checkpoint-only run uses."""
    w = load_workload(str(DLIO / "llama_1t.yaml"), [
        *TINY_LLM, *folders(tmp_path), "model.parallelism.tensor=1",
        "model.parallelism.pipeline=1", "dataset.record_length_bytes=4096"])
    s = run(w)
    assert [(c["kind"], c["name"]) for c in s["checkpoints"]] == [
        ("save", "global_epoch1_step8")]
    assert any("num_checkpoints_read" in n for n in s["notes"])


# --------------------------------------------------------------------------- bug 4
def test_shipped_configs_are_the_published_files() -> None:
    shipped = shipped_configs()
    for name, path in shipped.items():
        assert Path(path).read_bytes() == (MLPERF / f"{name}.yaml").read_bytes(), name
    assert load_workload(shipped["unet3d_h100"]).do_checkpoint


# --------------------------------------------------------------------------- bug 5
def test_one_step_per_epoch_says_nothing_was_measured(tmp_path: Path) -> None:
    w = load_workload(str(MLPERF / "unet3d_h100.yaml"), [
        *folders(tmp_path), "workflow.generate_data=True", "dataset.num_files_train=7",
        "dataset.record_length_bytes=4096", "train.epochs=2", "train.computation_time=0.001",
        "checkpoint.checkpoint_after_epoch=2"])
    s = run(w)
    assert "AU 0.0%" not in s["verdict"]
    assert s["verdict"].startswith("nothing was measured: 1 step per epoch")
    assert "exclude_start_steps" in s["verdict"]
    assert "checkpoint 0.000 GiB saved in" in s["verdict"]  # what was measured still shows


# --------------------------------------------------------------------------- bug 6a
def test_record_length_override_scales_the_spread() -> None:
    """--set record_length_bytes keeps the published spread's proportion, and says so."""
    w = load_workload(str(MLPERF / "unet3d_h100.yaml"), ["dataset.record_length_bytes=8192"])
    assert w.record_length_stdev == round(68341808 * 8192 / 146600628)
    assert any("record_length_bytes_stdev" in n and "scaled" in n for n in w.notes)
    kept = load_workload(str(MLPERF / "unet3d_h100.yaml"), [
        "dataset.record_length_bytes=8192", "dataset.record_length_bytes_stdev=100"])
    assert kept.record_length_stdev == 100


def test_measured_read_rate_is_over_the_measured_steps(tmp_path: Path) -> None:
    """Exact-size samples: the bytes read in the metric steps over their time equal DLIO's
    samples/s x record_length, so the two figures differ only when sample sizes do."""
    w = load_workload(str(MLPERF / "unet3d_h100.yaml"), [
        *folders(tmp_path), "workflow.generate_data=True", "workflow.checkpoint=False",
        "dataset.format=indexed_binary", "dataset.num_files_train=2",
        "dataset.num_samples_per_file=12", "dataset.record_length_bytes=4096",
        "dataset.record_length_bytes_stdev=0", "reader.batch_size=2", "train.epochs=1",
        "train.computation_time=0.002", "reader.preprocess_time=0.001"])
    m = run(w)["metric"]
    assert m["train_io_measured_mean_MB_per_second"] == pytest.approx(
        m["train_io_mean_MB_per_second"], rel=1e-9)


def test_wait_for_a_batch_leaves_out_the_excluded_steps() -> None:
    rec = RankRecorder(0, batch_size=1)
    rec.start_epoch(1)
    for load in (0.05, 0.002, 0.002, 0.002):  # the first step waits for the readers
        time.sleep(load + 0.003)
        rec.step(1, load, 0.003, load + 0.003, 10)
    rec.end_epoch(1)
    assert rec.epoch_metrics(1)["load_mean_s"] == pytest.approx(0.002)
    agg = aggregate([rec.to_dict()], 10, 0.9, 0)
    summary = {"metric": agg["metric"], "per_epoch": agg["per_epoch"],
               "per_rank": agg["per_rank"]}
    assert "2.0 ms" in verdict(summary, 0.9), verdict(summary, 0.9)


def test_cli_explains_the_two_read_rates(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from lcache.cli.main import cli

    sets = [*folders(tmp_path), "workflow.generate_data=True", "workflow.checkpoint=False",
            "dataset.num_files_train=8", "dataset.record_length_bytes=4096",
            "reader.batch_size=2", "train.epochs=1", "train.computation_time=0.001"]
    args = [a for s in sets for a in ("--set", s)]
    res = CliRunner().invoke(cli, ["bench", "run", str(MLPERF / "unet3d_h100.yaml"), *args])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "train_io_mean_MB_per_second = samples/s x record_length" in text
    assert os.path.exists(tmp_path / "out" / "summary.json")


# --------------------------------------------------------------------------- 6: sample sizes
def test_record_length_stdev_is_dlios_two_sided_draw(tmp_path: Path) -> None:
    """DLIO (data_generator.py get_dimension) draws two sides per file after seed 10, each
    N(sqrt L, stdev / (2 sqrt L)), and a sample holds side1 x side2 bytes."""
    import math

    import numpy as np

    from lcache.bench import datagen

    w = load_workload(str(MLPERF / "unet3d_h100.yaml"), ["dataset.num_files_train=2000"])
    np.random.seed(10)  # DLIO's own code, as the oracle
    side = int(math.sqrt(w.record_length))
    dim = [max(int(d), 1) for d in np.random.normal(
        side, w.record_length_stdev / 2.0 / math.sqrt(w.record_length), 2 * 2000)]
    np.random.seed()
    expect = [dim[2 * i] * dim[2 * i + 1] for i in range(2000)]
    assert datagen.sample_sizes(w).tolist() == expect
    assert min(expect) > 1 << 20  # no 1-byte files, as N(L, stdev) clamped at 1 gave
    # and the files hold exactly that many bytes per sample
    small = load_workload(str(MLPERF / "unet3d_h100.yaml"), [
        *folders(tmp_path), "dataset.format=indexed_binary", "dataset.num_files_train=3",
        "dataset.num_samples_per_file=2", "dataset.record_length_bytes=4096"])
    datagen.generate(small, str(tmp_path / "data"))
    sizes = datagen.sample_sizes(small)
    got = [(tmp_path / "data" / "train" / f"img_{i}_of_3.indexed_binary").stat().st_size
           for i in range(3)]
    assert got == [2 * int(s) for s in sizes] and len(set(got)) == 3


def test_a_set_size_may_have_a_unit() -> None:
    w = load_workload(str(MLPERF / "unet3d_h100.yaml"), ["dataset.record_length_bytes=8MiB"])
    assert w.record_length == 8 << 20
    with pytest.raises(ConfigError, match="record_length_bytes must be an integer"):
        load_workload(str(MLPERF / "unet3d_h100.yaml"), ["dataset.record_length_bytes=8 apples"])


# --------------------------------------------------------------------------- 7: prefetch
@pytest.mark.parametrize(("loader", "threads", "prefetch", "ahead"), [
    ("pytorch", 4, 2, 4), ("pytorch", 2, 5, 6), ("pytorch", 4, 0, 8), ("pytorch", 0, 2, 0),
    ("tensorflow", 4, 2, 4), ("tensorflow", 1, 8, 8), ("tensorflow", 0, 0, 1)])
def test_readers_keep_about_prefetch_size_batches(loader: str, threads: int, prefetch: int,
                                                  ahead: int) -> None:
    """DLIO's DataLoader: prefetch_factor = ceil(prefetch_size / read_threads) per worker."""
    from lcache.bench.config import parse_workload
    from lcache.bench.reader import batches_ahead

    w = parse_workload({"framework": loader, "dataset": {"format": "npz"},
                        "reader": {"read_threads": threads, "prefetch_size": prefetch}})
    assert batches_ahead(w) == ahead


def test_reads_in_flight_stay_within_prefetch(tmp_path: Path) -> None:
    import threading

    from lcache.bench import datagen
    from lcache.bench.reader import SampleReader, batches_ahead, iterate_batches

    w = load_workload(str(MLPERF / "unet3d_h100.yaml"), [
        *folders(tmp_path), "dataset.num_files_train=40", "dataset.record_length_bytes=4096",
        "reader.batch_size=1", "reader.read_threads=4", "reader.prefetch_size=2"])
    datagen.generate(w, str(tmp_path / "data"))
    busy, most, lock = [0], [0], threading.Lock()

    class Counting(SampleReader):
        def read_batch(self, samples: Any) -> int:
            with lock:
                busy[0] += 1
                most[0] = max(most[0], busy[0])
            time.sleep(0.002)
            with lock:
                busy[0] -= 1
            return super().read_batch(samples)

    reader = Counting(w, datagen.list_files(w, str(tmp_path / "data")))
    import numpy as np

    got = list(iterate_batches(reader, np.arange(40), 1, 4, batches_ahead(w)))
    reader.close()
    assert len(got) == 40 and most[0] <= batches_ahead(w) == 4


# --------------------------------------------------------------------------- 8: order
def test_tfrecord_order_is_tf_datas(tmp_path: Path) -> None:
    """tf_reader.py: rank r takes files r, r+W, ..; read_threads files interleave record by
    record; file_shuffle shuffles the list once with numpy's seed(seed + 1)."""
    import numpy as np

    from lcache.bench.config import parse_workload
    from lcache.bench.order import epoch_order

    doc: dict[str, Any] = {"framework": "tensorflow", "dataset": {
        "format": "tfrecord", "num_files_train": 8, "num_samples_per_file": 2},
        "reader": {"read_threads": 2, "batch_size": 2}}
    w = parse_workload(doc)
    assert epoch_order(w, 1, 0, 2, 8).tolist() == [0, 4, 1, 5, 8, 12, 9, 13]
    assert epoch_order(w, 3, 0, 2, 8).tolist() == [0, 4, 1, 5, 8, 12, 9, 13]
    doc["reader"]["file_shuffle"] = "seed"
    files = np.arange(8)
    np.random.RandomState(123 + 1).shuffle(files)
    mine = files[0::2]
    expect = [f * 2 + j for g in (mine[:2], mine[2:]) for j in (0, 1) for f in g]
    assert epoch_order(parse_workload(doc), 1, 0, 2, 8).tolist() == expect
    # sample_shuffle: a shuffle buffer of shuffle_size records, not a global permutation
    doc["reader"].update(file_shuffle="off", sample_shuffle="seed", shuffle_size=2,
                         read_threads=1)
    doc["dataset"]["num_files_train"] = 32
    order = epoch_order(parse_workload(doc), 1, 0, 1, 32).tolist()
    assert sorted(order) == list(range(64)) and order != list(range(64))
    assert all(x <= i + 2 for i, x in enumerate(order))  # at most `shuffle_size` ahead


def test_cli_order_shuffle_is_an_explicit_option(tmp_path: Path) -> None:
    w = load_workload(str(MLPERF / "unet3d_h100.yaml"), [
        *folders(tmp_path), "workflow.generate_data=True", "workflow.checkpoint=False",
        "dataset.num_files_train=16", "dataset.record_length_bytes=4096",
        "dataset.record_length_bytes_stdev=0", "reader.batch_size=2", "train.epochs=1"])
    dlio = run(w)
    mixed = run(w, order="shuffle")
    assert (dlio["order"], mixed["order"]) == ("dlio", "shuffle")
    assert any("--order shuffle" in n for n in dlio["notes"])


# --------------------------------------------------------------------------- 9, 11: checkpoints
def test_unet3d_checkpoint_is_dlios_default_size(tmp_path: Path) -> None:
    """MLPerf's unet3d sets model.model_size, which DLIO never reads: it writes 10,240 bytes
    (model.model_size_bytes' default) from rank 0."""
    w = load_workload(str(MLPERF / "unet3d_h100.yaml"), [
        *folders(tmp_path), "workflow.generate_data=True", "dataset.num_files_train=14",
        "dataset.record_length_bytes=4096", "train.epochs=1", "train.computation_time=0.001",
        "checkpoint.checkpoint_after_epoch=1"])
    s = run(w)
    (ck,) = (tmp_path / "ck").iterdir()
    assert ck.name == "global_epoch1_step2"
    assert [(p.name, p.stat().st_size) for p in ck.iterdir()] == [("model_states-0.pt", 10240)]
    assert any("model.model_size has no effect" in n for n in s["notes"])


def test_checkpoint_layout_follows_dlio_by_zero_stage() -> None:
    from lcache.bench import checkpoint as ckpt
    from lcache.bench.config import parse_workload

    def names(w: Any, world: int) -> list[list[str]]:
        return [[f.name for f in ckpt.rank_files(w, r, world)] for r in range(world)]

    # ZeRO 1, pipeline 1 (DLIO's llama_7b): one model file from data-parallel rank 0
    zero1 = load_workload(str(DLIO / "llama_7b.yaml"), TINY_LLM)
    assert names(zero1, 2) == [["model_0_model_states.pt",
                                "zero_pp_rank_0_mp_rank_0_optim_states.pt"],
                               ["zero_pp_rank_1_mp_rank_0_optim_states.pt"]]
    # ZeRO 0, tensor 2: only the ranks below tp x pp write, model and optimizer whole
    zero0 = parse_workload({"framework": "pytorch", "model": {
        "type": "transformer", "num_layers": 2, "parallelism": {"tensor": 2},
        "transformer": {"hidden_size": 64, "ffn_hidden_size": 128, "vocab_size": 256,
                        "num_attention_heads": 4, "num_kv_heads": 2}}})
    assert names(zero0, 4) == [
        ["zero_pp_rank_0_mp_rank_0_model_states.pt", "zero_pp_rank_0_mp_rank_0_optim_states.pt"],
        ["zero_pp_rank_0_mp_rank_1_model_states.pt", "zero_pp_rank_0_mp_rank_1_optim_states.pt"],
        [], []]
    # pipeline 4 (DLIO's llama_70b): one file per layer, layers split over the stages
    pp = load_workload(str(DLIO / "llama_70b.yaml"), [*TINY_LLM, "model.num_layers=8"])
    first = names(pp, 32)
    assert first[0][:3] == ["layer_0-model_0_model_states.pt",
                            "layer_1-model_0_model_states.pt",
                            "layer_2-model_0_model_states.pt"]
    layers = sorted(int(n.split("-")[0][6:]) for r in range(8, 32, 8) for n in first[r]
                    if n.startswith("layer_"))
    assert layers == [3, 4, 5, 6, 7, 8, 9, 10]  # stages 1-3; L+1, L+2 on the last


def test_dlio_legacy_tensor_lists() -> None:
    """megatron_deepspeed_LLNL: layer_parameters per layer (split by tp, 1 byte each) on
    pipeline stage layers 1..L, optimization_groups as a, b per group plus their sum."""
    from lcache.bench import checkpoint as ckpt

    w = load_workload(str(DLIO / "megatron_deepspeed_LLNL.yaml"))
    files = {f.name: f.nbytes for f in ckpt.rank_files(w, 0, 32)}
    per_layer = 52583936 // 4 + 209715200 // 4
    assert files == {"model_states-0.pt": 10240,
                     **{f"layer_{i}-model_0_model_states.pt": per_layer for i in range(1, 6)},
                     "zero_pp_rank_0_mp_rank_0_optim_states.pt": 3 * 1875123200}
    stage1 = {f.name for f in ckpt.rank_files(w, 4, 32) if f.name.startswith("layer_")}
    assert stage1 == {f"layer_{i}-model_4_model_states.pt" for i in range(6, 11)}


# --------------------------------------------------------------------------- 10, 14
def test_metric_window_is_read_where_dlio_reads_it() -> None:
    from lcache.bench.config import parse_workload

    w = parse_workload({"output": {"metric": {"exclude_start_steps": 2,
                                              "exclude_end_steps": 1}}})
    assert (w.exclude_start_steps, w.exclude_end_steps) == (2, 1)
    with pytest.raises(ConfigError, match=r"output\.metric\.exclude_start_steps"):
        parse_workload({"metric": {"exclude_start_steps": 2}})


def test_subfolders_as_dlio_lays_them_out(tmp_path: Path) -> None:
    """DLIO's default workload: 2 sub-folders for training and for evaluation."""
    w = load_workload(str(DLIO / "default.yaml"), [
        *folders(tmp_path), "workflow.generate_data=True", "dataset.num_files_train=8",
        "dataset.num_files_eval=4", "train.epochs=1", "train.computation_time=0.001",
        "evaluation.eval_time=0.001"])
    s = run(w)
    train = tmp_path / "data" / "train"
    assert sorted(str(p.relative_to(train)) for p in train.rglob("*.npz")) == [
        f"{i % 2}/img_{i}_of_8.npz" for i in (0, 2, 4, 6, 1, 3, 5, 7)]
    assert len(list((tmp_path / "data" / "valid").rglob("*.npz"))) == 4
    assert s["per_epoch"][0]["bytes_read"] == sum(p.stat().st_size
                                                  for p in train.rglob("*.npz"))
    assert s["per_eval"][0]["steps"] == 4
