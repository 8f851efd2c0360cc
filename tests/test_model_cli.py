"""``lcache model`` on the command line, and YAML model files."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from lcache.cli.main import cli
from lcache.errors import ConfigError
from lcache.model import CLASSES, config_from_preset, load_model_file, predict

from .conftest import assert_one_line_error, run_lcache

CLASS_KEYS = {"direction", "bytes_per_step", "bytes_per_event", "bytes_per_day", "per_node",
              "per_gpu", "per_node_bytes_per_day", "per_gpu_bytes_per_day",
              "MBps_needed_overlap", "MBps_needed_no_overlap"}
SSD_KEYS = {"write_bytes_per_day_per_node", "dwpd", "keeps_up", "margin", "verdict"}

LLAMA_8B_YAML = """\
name: my-8b
layers: 32
hidden: 4096
ffn_hidden: 14336
heads: 32
kv_heads: 8
vocab: 128256
seq_len: 8192
training:
  gpus: 16
  tp: 2
  checkpoint_interval_steps: 50
  ssd_capacity_bytes: 7.68TB
"""


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["model", *args])
    return result.exit_code, result.output


def test_json_has_the_promised_keys() -> None:
    code, out = _run("llama3-70b", "--gpus", "128", "--optimizer-offload", "--json")
    assert code == 0, out
    doc = json.loads(out)
    for key in ("step_time_s", "params", "checkpoint_bytes", "checkpoint_interval_steps",
                "classes", "ssd"):
        assert key in doc
    assert set(doc["classes"]) == set(CLASSES)
    for c in doc["classes"].values():
        assert set(c) >= CLASS_KEYS
    assert set(doc["ssd"]) >= SSD_KEYS
    assert isinstance(doc["ssd"]["keeps_up"], bool)
    assert doc["gpus"] == 128 and doc["dp"] == 16
    assert doc["classes"]["optimizer-offload"]["enabled"] is True
    # The CLI prints what the library computes.
    lib = predict(config_from_preset("llama3-70b", gpus=128, optimizer_offload=True)).to_dict()
    assert doc["checkpoint_bytes"] == lib["checkpoint_bytes"]
    assert doc["step_time_s"] == pytest.approx(lib["step_time_s"])


def test_options_reach_the_config() -> None:
    code, out = _run("llama3-8b", "--gpus", "16", "--gpu", "a100", "--mfu", "0.5",
                     "--ckpt-minutes", "15", "--ssd-capacity", "7.68TB", "--ssd-write", "2GB",
                     "--seq-len", "4096", "--recompute", "full", "--zero", "1", "--json")
    assert code == 0, out
    cfg = json.loads(out)["config"]
    assert (cfg["gpus"], cfg["gpu"], cfg["mfu"], cfg["checkpoint_interval_minutes"]) == \
        (16, "a100", 0.5, 15.0)
    assert cfg["ssd_capacity_bytes"] == 7_680_000_000_000
    assert cfg["ssd_write_bytes_per_s"] == 2_000_000_000
    assert cfg["model"]["seq_len"] == 4096 and cfg["recompute"] == "full"
    assert cfg["peak_flops"] == 312e12


def test_table_prints_sizes_in_both_units_and_a_verdict() -> None:
    code, out = _run("llama3-8b")
    assert code == 0, out
    assert "112.4 GB" in out and "104.7 GiB" in out
    assert "verdict:" in out and "keeps up" in out


def test_table_shows_checkpoint_bytes_amortized_per_step() -> None:
    """The finding (newcomer helper 55): the per step row said 0 for checkpoint-write beside
    987.8 GB per checkpoint every 22 steps; it shows 987.8 GB / 22, and says so."""
    code, out = _run("llama3-70b")
    assert code == 0, out
    row = out[out.index("per step"):out.index("per event")]
    assert "44.9 GB" in row and "amortized: 1" in row and "per 22 steps" in row, row
    assert "│                0 │" not in row, row


@pytest.mark.parametrize("how", ["option", "model file"])
def test_no_restarts_a_day_prints_never(tmp_path: Path, how: str) -> None:
    """The finding (attack helper 69, finding 1): 0 restarts a day, a legitimate setting, made
    checkpoint-read's steps per event infinite (null in JSON) and the table a TypeError; its
    per step cell says the restart never happens."""
    path = tmp_path / "m.yaml"
    path.write_text("preset: llama3-8b\ntraining: {restarts_per_day: 0}\n")
    args = ("llama3-8b", "--restarts-per-day", "0") if how == "option" else \
        ("--model-file", str(path))
    result = CliRunner().invoke(cli, ["model", *args])
    assert result.exit_code == 0 and result.exception is None, result.output
    row = result.output[result.output.index("per step"):result.output.index("per event")]
    assert "never: no restart" in row and "per 22 steps" in row, row
    code, out = _run(*args, "--json")
    assert code == 0 and json.loads(out)["classes"]["checkpoint-read"]["steps_per_event"] is None


def test_model_name_reaches_the_terminal_escaped(tmp_path: Path) -> None:
    """The finding (attack helper 69, finding 10): a model file's name went into the table's
    title raw, so its ESC sequences acted on the terminal and its [markup] on rich; it is
    shown escaped, as ``ckpt`` shows names."""
    path = tmp_path / "red.yaml"
    path.write_text('preset: llama3-8b\nname: "\\x1b[31mred [bold]x"\n')
    run = run_lcache("model", "--model-file", str(path), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "\x1b" not in run.stdout, run.stdout[:300]
    assert "\\x1b[31mred [bold]x" in run.stdout.replace("\n", " "), run.stdout[:300]
    # the GPU's name too: "h100[/]x" was a MarkupError traceback (attack helper 85)
    path.write_text('preset: llama3-8b\ntraining: {gpu: "h100[/]x", peak_flops: 1.0e+15, '
                    'hbm_bytes: 80000000000}\n')
    run = run_lcache("model", "--model-file", str(path), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "h100[/]x" in run.stdout.replace("\n", " "), run.stdout[:300]


def test_real_subprocess_json() -> None:
    out = subprocess.run([sys.executable, "-m", "lcache", "model", "bert-large", "--json"],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    assert json.loads(out)["params"] == 335_141_888


def test_bad_input_is_one_clear_line() -> None:
    code, out = _run("llama3-8b", "--gpus", "12", "--tp", "8")
    assert code == 2 and "multiple of tp x pp" in out and "Traceback" not in out
    code, out = _run()
    assert code == 2 and "give a preset" in out
    code, out = _run("nope")
    assert code == 2 and "unknown model preset 'nope'" in out


@pytest.mark.parametrize(("args", "words"), [
    (("--peak-tflops", "inf"), "peak_flops must be a finite number, got inf"),
    (("--peak-tflops", "1e308"), "--peak-tflops 1e+308"),  # 1e308 x 1e12 is inf
    (("--ckpt-minutes", "inf"), "--ckpt-minutes inf"),
    (("--restarts-per-day", "nan"), "--restarts-per-day nan"),
    (("--restarts-per-day", "inf"), "--restarts-per-day inf"),
    (("--ssd-dwpd", "inf"), "--ssd-dwpd inf"),
    (("--restart-budget", "inf"), "--restart-budget inf"),
    (("--max-stall", "2"), "max_stall_fraction is a share of time in (0, 1), got 2.0"),
    (("--max-stall", "nan"), "--max-stall nan"),
    (("--restart-budget", "90000"), "more than a day"),
    (("--peak-tflops", "1e280", "--ckpt-minutes", "1e300"), "settings out of range"),
])
@pytest.mark.parametrize("as_json", [False, True])
def test_infinite_nan_or_out_of_range_settings_are_one_line(args: tuple[str, ...], words: str,
                                                            as_json: bool) -> None:
    """Regression: inf/nan settings crashed in predict() or printed nulls with rc 0, and
    --max-stall 2 / --restart-budget inf were accepted."""
    result = CliRunner().invoke(cli, ["model", "llama3-8b", *args,
                                      *(["--json"] if as_json else [])])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert words in result.output and "Traceback" not in result.output, result.output
    assert result.output.count("\n") == 1 and result.output.startswith("error:"), result.output


@pytest.mark.parametrize("setting", ["peak_flops: .inf", "checkpoint_interval_minutes: .inf",
                                     "restarts_per_day: .nan", "ssd_rated_dwpd: .inf",
                                     "restart_budget_s: .inf", "max_stall_fraction: 1.5",
                                     "gpus: " + "9" * 400])
def test_model_file_infinite_settings_are_one_line(tmp_path: Path, setting: str) -> None:
    path = tmp_path / "inf.yaml"
    path.write_text(f"preset: llama3-8b\ntraining:\n  {setting}\n")
    name = setting.split(":")[0]
    with pytest.raises(ConfigError, match=name) as info:
        load_model_file(path)
    assert str(path) in str(info.value)
    code, out = _run("--model-file", str(path), "--json")
    assert code == 2 and name in out and "Traceback" not in out, out
    assert out.count("\n") == 1, out


def test_list_presets() -> None:
    code, out = _run("--list", "--json")
    assert code == 0
    assert set(json.loads(out)) == {"llama3-8b", "llama3-70b", "llama3-405b", "gpt3-175b",
                                    "bert-large"}


# -- YAML model files ----------------------------------------------------------------------------

def test_model_file_equals_the_preset(tmp_path: Path) -> None:
    path = tmp_path / "my8b.yaml"
    path.write_text(LLAMA_8B_YAML)
    cfg = load_model_file(path)
    assert cfg.model.name == "my-8b" and cfg.gpus == 16 and cfg.tp == 2
    assert cfg.ssd_capacity_bytes == 7_680_000_000_000
    ours = predict(cfg)
    assert ours.params == predict(config_from_preset("llama3-8b")).params
    assert ours.checkpoint_interval_steps == 50
    code, out = _run("--model-file", str(path), "--gpus", "32", "--json")
    assert code == 0, out
    assert json.loads(out)["gpus"] == 32  # the command line wins over the file


def test_model_file_from_a_preset_with_changes(tmp_path: Path) -> None:
    path = tmp_path / "long.yaml"
    path.write_text("preset: llama3-8b\nseq_len: 32768\ntraining: {global_batch: 128}\n")
    cfg = load_model_file(path)
    assert cfg.model.seq_len == 32768 and cfg.model.layers == 32 and cfg.global_batch == 128
    assert cfg.gpus == 8  # the preset's training defaults still apply


@pytest.mark.parametrize(("text", "words"), [
    (LLAMA_8B_YAML.replace("ffn_hidden:", "ffn_hiden:"), "unknown key 'ffn_hiden'"),
    (LLAMA_8B_YAML.replace("  gpus: 16", "  gpu_count: 16"), "unknown setting 'gpu_count'"),
    (LLAMA_8B_YAML.replace("heads: 32\n", "heads: many\n", 1), "heads must be a positive"),
    (LLAMA_8B_YAML.replace("layers: 32\n", ""), "lacks layers"),
    (LLAMA_8B_YAML.replace("  tp: 2", "  tp: 3"), "multiple of tp x pp"),
    (LLAMA_8B_YAML.replace("  gpus: 16", "  gpus: sixteen"), "gpus must be"),
    ("- a list\n", "must hold a mapping"),
    ("layers: [1, 2\n", "not valid YAML"),
])
def test_bad_model_file_names_the_key_and_the_file(tmp_path: Path, text: str,
                                                   words: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words) as info:
        load_model_file(path)
    assert str(path) in str(info.value)
    code, out = _run("--model-file", str(path))
    assert code == 2 and "bad.yaml" in out and "Traceback" not in out


def test_missing_model_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_model_file(tmp_path / "none.yaml")


# -- docs/model.md's examples run as written -----------------------------------------------------

DOC = Path(__file__).resolve().parent.parent / "docs" / "model.md"


def test_doc_python_examples_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    assert blocks
    for code in blocks:
        exec(compile(code, str(DOC), "exec"), {"__name__": "__doc__"})


def test_doc_yaml_example_loads(tmp_path: Path) -> None:
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    assert blocks
    path = tmp_path / "doc.yaml"
    path.write_text(blocks[0])
    cfg = load_model_file(path)
    assert cfg.model.name == "my-8b" and cfg.checkpoint_interval_steps == 50


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # /dev/zero grew without end


BOMB = ("training:\n  gpus:\n    - &a [" + ", ".join(["lol"] * 9) + "]\n"
        + "".join(f"    - &{chr(97 + i)} [" + ", ".join(["*" + chr(96 + i)] * 9) + "]\n"
                  for i in range(1, 9)))


@pytest.mark.parametrize(("text", "words"), [
    (BOMB, "aliases (*name) are not allowed in a model file"),
    ("layers: !!python/object/apply:os.system [true]\n", "the tag !!python/object/apply"),
    ("layers: 32\nlayers: 2\n", "line 2, column 1: the key 'layers' is given twice"),
    ("/dev/zero", "/dev/zero is not a regular file"),
    ("fifo", "fifo is not a regular file"),
    ("# padding\n" * 200_000, "over 1 MiB"),
])
def test_model_file_that_is_not_plain_yaml_is_one_line(tmp_path: Path, text: str,
                                                       words: str) -> None:
    if text == "/dev/zero":
        path = Path(text)
    elif text == "fifo":
        path = tmp_path / "fifo"
        os.mkfifo(path)  # reading it would wait for a writer forever
    else:
        path = tmp_path / "bad.yaml"
        path.write_text(text)
    run = subprocess.run([sys.executable, "-m", "lcache", "model", "--model-file", str(path)],
                         capture_output=True, text=True, timeout=60, preexec_fn=_limited,
                         env={**os.environ, "COLUMNS": "1000"})
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.stderr.count("\n") == 1 and words in run.stderr, run.stderr



@pytest.mark.parametrize(("args", "words"), [
    # per-node figures were the job's over "3 nodes" for 8 GPUs
    (("llama3-8b", "--gpus-per-node", "3"), ("gpus 8 is not a multiple of gpus_per_node 3",)),
    (("llama3-8b", "--gpus", "12"), ("gpus 12 is not a multiple of gpus_per_node 8",)),
    # said "global_batch 512 is not a multiple of micro_batch x dp"
    (("llama3-8b", "--gpus", "99999999999999999999"), ("gpus", "out of range", "1,000,000")),
])
def test_gpus_that_fill_no_whole_nodes_or_too_many_are_one_line(tmp_path: Path,
                                                                args: tuple[str, ...],
                                                                words: tuple[str, ...]) -> None:
    err = assert_one_line_error(run_lcache("model", *args, cwd=tmp_path), *words)
    assert "global_batch" not in err


def test_gpus_within_one_node_or_whole_nodes_are_taken(tmp_path: Path) -> None:
    for args, nodes in ((("--gpus", "4"), 1), (("--gpus", "16", "--gpus-per-node", "4"), 4)):
        out = run_lcache("model", "llama3-8b", *args, "--json", cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["nodes"] == nodes


@pytest.mark.parametrize("line", ["layers: 99999999999999999999999999999", "hidden: 4294967296",
                                  "seq_len: 1000000000", "vocab: 10000000000"])
def test_model_file_dimensions_out_of_range_are_one_line(tmp_path: Path, line: str) -> None:
    """Regression: ``layers: 99999999999999999999999999999`` printed 10^29-second steps."""
    key = line.split(":")[0]
    shape = {"layers": 32, "hidden": 4096, "ffn_hidden": 14336, "heads": 32, "vocab": 128256,
             "seq_len": 8192}
    text = "\n".join([line] + [f"{k}: {v}" for k, v in shape.items() if k != key]) + "\n"
    (tmp_path / "m.yaml").write_text(text)
    out = run_lcache("model", "--model-file", str(tmp_path / "m.yaml"), cwd=tmp_path)
    assert_one_line_error(out, key, "out of range")


def test_an_unknown_preset_offers_a_model_file_only_where_one_can_be_given(
        tmp_path: Path) -> None:
    # (attack helper 47) advise, bench from-model and a model file's `preset:` were told to
    # give --model-file, which only `lcache model` takes
    hint = "--model-file"
    err = assert_one_line_error(run_lcache("model", "nope", cwd=tmp_path), "'nope'", hint)
    model = tmp_path / "m.yaml"
    model.write_text("layers: 2\nhidden: 64\npreset: nope\n")
    err = assert_one_line_error(run_lcache("model", "--model-file", str(model), cwd=tmp_path),
                                "'nope'", "m.yaml", "llama3-8b")
    assert hint not in err
    err = assert_one_line_error(run_lcache("bench", "from-model", "nope", "--dir",
                                           str(tmp_path / "d"), cwd=tmp_path),
                                "'nope'", "llama3-8b")
    assert hint not in err
    with pytest.raises(ConfigError) as exc:
        config_from_preset("nope")
    assert hint not in str(exc.value)
