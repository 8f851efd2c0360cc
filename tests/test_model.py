"""The analytic I/O model against published figures and hand-computed cases."""

from __future__ import annotations

import dataclasses

import pytest

from lcache.errors import ConfigError
from lcache.model import (
    CLASSES,
    PRESETS,
    TrainingConfig,
    config_from_preset,
    load_model_file,
    predict,
)
from lcache.model import formulas as f

GiB = 2**30


# -- parameters and checkpoint sizes against MLPerf Storage v2.0 ---------------------------------

def test_llama3_8b_params_on_the_dlio_formula_by_hand() -> None:
    # DLIO get_num_parameters: V h + L (2h + h (h + 2 d_kv) + h^2 + 3 h ffn) + h + V h
    h, ffn, L, V, d_kv = 4096, 14336, 32, 128256, 4096 // 32 * 8
    by_hand = V * h + L * (2 * h + h * (h + 2 * d_kv) + h * h + 3 * h * ffn) + h + V * h
    assert by_hand == 8_030_261_248
    assert f.param_count(PRESETS["llama3-8b"]) == by_hand


@pytest.mark.parametrize(("preset", "published_gib"), [
    # MLPerf Storage v2.0 checkpoint sizes; DLIO prints sizes in GiB under the name "GB", and
    # the 405B "5.29 TB" is 5,290 of those.
    ("llama3-8b", 105.0), ("llama3-70b", 912.0), ("llama3-405b", 5290.0)])
def test_checkpoint_sizes_match_mlperf_storage_within_2_percent(preset: str,
                                                                published_gib: float) -> None:
    p = predict(config_from_preset(preset))
    assert p.checkpoint_bytes == p.params * 14
    assert p.checkpoint_bytes / GiB == pytest.approx(published_gib, rel=0.02)


def test_issue_example_8b_is_112_4_GB_or_104_7_GiB() -> None:
    p = predict(config_from_preset("llama3-8b"))
    assert p.checkpoint_bytes / 1e9 == pytest.approx(112.4, abs=0.05)
    assert p.checkpoint_bytes / GiB == pytest.approx(104.7, abs=0.05)


def test_70b_with_mlperf_config_heads_gives_912_exactly() -> None:
    # MLPerf's llama3_70b.yaml says 128 heads (the real model has 64); with its shape our count
    # lands on its figure, which shows the 0.9% gap of the real shape is that key alone.
    p = predict(config_from_preset("llama3-70b", heads=128))
    assert p.checkpoint_bytes / GiB == pytest.approx(912.0, rel=0.002)


def test_published_parameter_counts() -> None:
    assert f.param_count(PRESETS["bert-large"]) == 335_141_888  # transformers BertModel
    assert f.param_count(PRESETS["gpt3-175b"]) == pytest.approx(175.0e9, rel=0.005)
    assert f.param_count(PRESETS["llama3-70b"]) == pytest.approx(70.6e9, rel=0.002)
    assert f.param_count(PRESETS["llama3-405b"]) == pytest.approx(405e9, rel=0.005)


def test_bytes_per_param_checkpoint_14_memory_16() -> None:
    assert f.checkpoint_bytes_per_param() == 14
    assert f.memory_bytes_per_param() == 16
    assert f.checkpoint_bytes_per_param(optimizer_state_dtype="bf16") == 2 + 4 + 2 + 2
    p = predict(config_from_preset("llama3-8b"))
    assert p.memory["model_state_bytes"] == 16 * p.params
    assert p.memory["bytes_per_param"] == 16


def test_zero_stages_shard_what_the_paper_says() -> None:
    kw = {"tp": 2, "pp": 2, "dp": 4, "weight_bytes": 2, "grad_bytes": 2, "optimizer_bytes": 12}
    n = 1_600_000
    shard = n / 4
    s0 = f.model_state_bytes_per_gpu(n, zero_stage=0, **kw)
    assert s0 == {"weights_bytes": 2 * shard, "gradients_bytes": 2 * shard,
                  "optimizer_bytes": 12 * shard}
    s1 = f.model_state_bytes_per_gpu(n, zero_stage=1, **kw)
    assert s1["optimizer_bytes"] == 12 * shard / 4 and s1["gradients_bytes"] == 2 * shard
    s2 = f.model_state_bytes_per_gpu(n, zero_stage=2, **kw)
    assert s2["gradients_bytes"] == 2 * shard / 4 and s2["weights_bytes"] == 2 * shard
    s3 = f.model_state_bytes_per_gpu(n, zero_stage=3, **kw)
    assert sum(s3.values()) == 16 * n / 16
    off = f.model_state_bytes_per_gpu(n, zero_stage=1, optimizer_offloaded=True, **kw)
    assert off["optimizer_bytes"] == 0


# -- activations (Korthikanti et al. 2022) -------------------------------------------------------

def test_activation_formula_hand_computed_gpt3_layer() -> None:
    s, b, h, a = 2048, 1, 12288, 96
    # 5 a s / h = 5 * 96 * 2048 / 12288 = 80, so sbh (34 + 80) = 2048 * 12288 * 114
    assert f.activation_bytes_per_layer(s, b, h, a) == 2_868_903_936
    assert f.activation_bytes_per_layer(s, b, h, a, recompute="selective") == 34 * s * b * h
    assert f.activation_bytes_per_layer(s, b, h, a, recompute="full") == 2 * s * b * h
    # Tensor parallel 8: with sequence parallelism everything divides by t (eq. 4) ...
    assert f.activation_bytes_per_layer(s, b, h, a, tp=8) == 2_868_903_936 / 8
    # ... without it, sbh (10 + 24/t + 5as/(ht)) = sbh (10 + 3 + 10) (eq. 2).
    assert f.activation_bytes_per_layer(s, b, h, a, tp=8, sequence_parallel=False) == \
        s * b * h * 23
    assert f.activation_bytes_per_layer(s, 4, h, a) == 4 * 2_868_903_936
    with pytest.raises(ConfigError, match="recompute"):
        f.activation_bytes_per_layer(s, b, h, a, recompute="some")


# -- FLOPs and step time --------------------------------------------------------------------------

def test_flops_are_6n_per_token_plus_attention() -> None:
    m = PRESETS["gpt3-175b"]
    n = f.param_count(m)
    attention = 12 * 96 * 12288 * 2048
    assert f.flops_per_token(m) == 6 * n + attention
    # Attention adds s / (6h) = 2.8% at GPT-3's 2048-token context, the term of Narayanan et
    # al. 2021 eq. 3 (their formula ignores biases and norms, hence the tolerance).
    assert f.flops_per_token(m) / (6 * n) == pytest.approx(1 + 2048 / (6 * 12288), rel=1e-3)


def test_step_time_is_model_flops_over_achieved_flops() -> None:
    cfg = config_from_preset("llama3-8b", gpus=64, mfu=0.5, global_batch=256)
    p = predict(cfg)
    tokens = 256 * 8192
    assert p.tokens_per_step == tokens
    assert p.step_time_s == pytest.approx(tokens * p.flops_per_token / (64 * 989.4e12 * 0.5))
    fp8 = predict(dataclasses.replace(cfg, precision="fp8"))
    assert fp8.step_time_s == pytest.approx(p.step_time_s / 2, rel=0.001)
    given = predict(dataclasses.replace(cfg, peak_flops=500e12))
    assert given.step_time_s == pytest.approx(p.step_time_s * 989.4 / 500)


# -- per-class I/O -------------------------------------------------------------------------------

def test_every_class_is_reported_with_its_direction() -> None:
    doc = predict(config_from_preset("llama3-70b", optimizer_offload=True,
                                     activation_offload=True)).to_dict()
    assert set(doc["classes"]) == set(CLASSES)
    directions = {k: v["direction"] for k, v in doc["classes"].items()}
    assert directions == {"data-read": "read", "checkpoint-write": "write",
                          "checkpoint-read": "read", "optimizer-offload": "readwrite",
                          "activation-offload": "readwrite"}
    for name in ("checkpoint-write", "checkpoint-read"):
        assert doc["classes"][name]["bytes_per_step"] == 0
        assert doc["classes"][name]["bytes_per_event"] == doc["checkpoint_bytes"]
    for c in doc["classes"].values():
        assert c["per_node_bytes_per_day"] == pytest.approx(c["bytes_per_day"] / doc["nodes"])
        assert c["per_gpu_bytes_per_day"] == pytest.approx(c["bytes_per_day"] / doc["gpus"])
        assert c["MBps_needed_no_overlap"] >= c["MBps_needed_overlap"] > 0


def test_event_classes_give_their_bytes_amortized_per_step() -> None:
    """The finding (newcomer helper 55): checkpoint-write showed "per step 0" beside 987.8 GB
    every 22 steps, read as no traffic. bytes_per_step stays what every step moves (0 for a
    checkpoint); amortized_bytes_per_step spreads the event over the steps between two."""
    doc = predict(config_from_preset("llama3-70b")).to_dict()
    ck, restart = doc["classes"]["checkpoint-write"], doc["classes"]["checkpoint-read"]
    interval = doc["checkpoint_interval_steps"]
    assert ck["steps_per_event"] == pytest.approx(interval)
    assert ck["amortized_bytes_per_step"] == pytest.approx(doc["checkpoint_bytes"] / interval)
    assert ck["per_node"]["amortized_bytes_per_step"] == pytest.approx(
        ck["amortized_bytes_per_step"] / doc["nodes"])
    steps_a_day = 86_400 / doc["step_time_s"]
    assert restart["amortized_bytes_per_step"] == pytest.approx(
        doc["checkpoint_bytes"] * doc["config"]["restarts_per_day"] / steps_a_day)
    data = doc["classes"]["data-read"]
    assert data["amortized_bytes_per_step"] == data["bytes_per_step"] > 0
    assert data["steps_per_event"] == pytest.approx(1.0)


def test_data_read_bytes_per_step() -> None:
    p = predict(config_from_preset("llama3-8b"))
    data = p.to_dict()["classes"]["data-read"]
    assert data["bytes_per_step"] == 512 * 8192 * 4  # int32 tokens for a 128K vocabulary
    assert data["MBps_needed_overlap"] == pytest.approx(
        512 * 8192 * 4 / p.step_time_s / 1e6)  # one node
    gpt = predict(config_from_preset("gpt3-175b", bytes_per_token=2)).to_dict()
    assert gpt["classes"]["data-read"]["bytes_per_step"] == 1536 * 2048 * 2


def test_checkpoint_interval_in_minutes_or_steps() -> None:
    p = predict(config_from_preset("llama3-8b", checkpoint_interval_minutes=10))
    assert p.checkpoint_interval_steps == round(600 / p.step_time_s)
    doc = predict(config_from_preset("llama3-8b", checkpoint_interval_steps=100)).to_dict()
    ckpt = doc["classes"]["checkpoint-write"]
    assert doc["checkpoint_interval_steps"] == 100
    assert ckpt["events_per_day"] == pytest.approx(86400 / (100 * doc["step_time_s"]))
    assert ckpt["bytes_per_day"] == pytest.approx(ckpt["events_per_day"] * doc["checkpoint_bytes"])
    # Overlapped, the write may take the whole interval; not overlapped, 5% of it.
    assert ckpt["MBps_needed_overlap"] == pytest.approx(
        doc["checkpoint_bytes"] / (100 * doc["step_time_s"]) / 1e6)
    assert ckpt["MBps_needed_no_overlap"] == pytest.approx(ckpt["MBps_needed_overlap"] * 20)


def test_optimizer_offload_reads_and_writes_the_state_every_step() -> None:
    p = predict(config_from_preset("llama3-70b", optimizer_offload=True))
    opt = p.to_dict()["classes"]["optimizer-offload"]
    assert opt["read_bytes_per_step"] == opt["write_bytes_per_step"] == 12 * p.params
    assert p.memory["per_gpu_optimizer_bytes"] == 0
    zero0 = predict(config_from_preset("bert-large", optimizer_offload=True))
    assert zero0.to_dict()["classes"]["optimizer-offload"]["read_bytes_per_step"] == \
        12 * zero0.params * 8  # no ZeRO: every data-parallel replica has its own copy
    off = predict(config_from_preset("llama3-70b")).to_dict()["classes"]["optimizer-offload"]
    assert not off["enabled"] and off["bytes_per_day"] == 0


def test_activation_offload_moves_every_micro_batch_out_and_back() -> None:
    cfg = config_from_preset("llama3-8b", activation_offload=True, recompute="none",
                             micro_batch=2)
    p = predict(cfg)
    per_layer = f.activation_bytes_per_layer(8192, 2, 4096, 32, recompute="none")
    micro = 512 // (2 * 8)
    act = p.to_dict()["classes"]["activation-offload"]
    assert act["write_bytes_per_step"] == pytest.approx(per_layer * 32 * micro * 8)
    assert act["read_bytes_per_step"] == act["write_bytes_per_step"]
    full = predict(dataclasses.replace(cfg, recompute="full")).to_dict()
    assert full["classes"]["activation-offload"]["write_bytes_per_step"] < \
        act["write_bytes_per_step"] / 10


# -- the SSD verdict ------------------------------------------------------------------------------

def test_dwpd_and_keeps_up_by_hand() -> None:
    cfg = config_from_preset("llama3-8b", checkpoint_interval_steps=10, ssds_per_node=2,
                             ssd_capacity_bytes=4_000_000_000_000)
    doc = predict(cfg).to_dict()
    ckpt = doc["classes"]["checkpoint-write"]
    assert doc["ssd"]["write_bytes_per_day_per_node"] == pytest.approx(ckpt["bytes_per_day"])
    assert doc["ssd"]["dwpd"] == pytest.approx(ckpt["bytes_per_day"] / 8e12)
    assert doc["ssd"]["keeps_up"] is True and doc["ssd"]["margin"] > 1
    assert "keeps up" in doc["ssd"]["verdict"]


def test_slow_ssds_do_not_keep_up_and_the_verdict_says_why() -> None:
    doc = predict(config_from_preset("llama3-405b", optimizer_offload=True,
                                     ssd_write_bytes_per_s="100MB")).to_dict()
    ssd = doc["ssd"]
    assert ssd["keeps_up"] is False
    assert ssd["margin"] < 1
    assert ssd["limited_by"] == "write_bandwidth"
    assert "does NOT keep up" in ssd["verdict"] and "write bandwidth" in ssd["verdict"]
    assert ssd["margin"] == pytest.approx(
        ssd["write_MBps_available_per_node"] / ssd["write_MBps_needed_per_node"])


def test_too_little_capacity_for_retention_fails() -> None:
    doc = predict(config_from_preset("llama3-8b", retention=5, ssds_per_node=1,
                                     ssd_capacity_bytes=500_000_000_000)).to_dict()
    assert doc["ssd"]["limited_by"] == "capacity" and not doc["ssd"]["keeps_up"]


# -- configuration errors -------------------------------------------------------------------------

@pytest.mark.parametrize(("overrides", "words"), [
    ({"gpus": 12, "tp": 8}, "multiple of tp x pp"),
    ({"dp": 3}, "must be equal"),
    ({"global_batch": 100}, "global_batch 100"),
    ({"checkpoint_interval_steps": 5, "checkpoint_interval_minutes": 5.0}, "not both"),
    ({"mfu": 40}, "write 0.4"),
    ({"gpu": "a100", "precision": "fp8"}, "no FP8"),
    ({"gpu": "v100"}, "unknown GPU kind 'v100'"),
    ({"zero_stage": 4}, "zero_stage"),
    ({"no_such_setting": 1}, "unknown setting 'no_such_setting'"),
    ({"tp": 3, "gpus": 3, "global_batch": 3}, "does not divide"),
    ({"mfu": "0.4"}, "mfu must be float"),
    ({"heads": 0}, "heads must be a positive integer"),
    ({"peak_flops": float("inf")}, "peak_flops must be a finite number, got inf"),
    ({"checkpoint_interval_minutes": float("inf")}, "checkpoint_interval_minutes must be a "
                                                    "finite"),
    ({"restarts_per_day": float("nan")}, "restarts_per_day must be a finite number, got nan"),
    ({"ssd_rated_dwpd": float("inf")}, "ssd_rated_dwpd must be a finite"),
    ({"ssd_write_bytes_per_s": float("inf")}, "ssd_write_bytes_per_s must be a finite"),
    ({"mfu": float("nan")}, "mfu must be a finite"),
    ({"gpus": 10**400}, "gpus must be a finite number, got an integer of 1329 bits"),
    ({"max_stall_fraction": 2.0}, r"max_stall_fraction is a share of time in \(0, 1\)"),
    ({"restart_budget_s": float("inf")}, "restart_budget_s must be a finite"),
    ({"restarts_per_day": 100.0, "restart_budget_s": 3600.0}, "more than a day"),
])
def test_bad_settings_say_what_to_change(overrides: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        config_from_preset("llama3-8b", **overrides)


def test_finite_settings_whose_figures_leave_float_range_are_refused() -> None:
    """Each setting finite and in range, yet together out of float range: a ConfigError,
    not an OverflowError (round(inf)) or infinities in the figures."""
    cfg = config_from_preset("llama3-8b", peak_flops=1e292, checkpoint_interval_minutes=1e300)
    with pytest.raises(ConfigError, match="settings out of range"):
        predict(cfg)


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(ConfigError, match="llama3-8b, llama3-70b"):
        config_from_preset("llama4")


@pytest.mark.parametrize(("call", "words"), [
    (lambda: predict(None), "cfg=None: give a TrainingConfig"),  # type: ignore[arg-type]
    (lambda: config_from_preset(5), "unknown model preset 5; choose one of llama3-8b"),  # type: ignore[arg-type]
    (lambda: load_model_file(None), "path=None: give a path"),  # type: ignore[arg-type]
])
def test_api_arguments_of_the_wrong_kind_are_named(call, words: str) -> None:  # type: ignore[no-untyped-def]
    """The finding (attack helper 87): predict(None) raised AttributeError ("'NoneType'
    object has no attribute 'validate'"), config_from_preset(5) AttributeError (no
    'lower'), load_model_file(None) a TypeError from Path()."""
    with pytest.raises(ConfigError, match=words):
        call()


def test_training_config_defaults_predict() -> None:
    doc = predict(TrainingConfig()).to_dict()
    assert doc["model"] == "llama3-8b" and doc["dp"] == 8 and doc["nodes"] == 1
