"""``lcache bench``: run DLIO workloads on real storage; emulate what ``lcache model`` predicts."""

from __future__ import annotations

import os
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from lcache import jsondoc
from lcache.checks import launch_rank_world, printable
from lcache.cli.checks import Folder
from lcache.errors import ConfigError
from lcache.terminate import UnwindOnTerminate

console = Console()


def _emit_json(doc: Any) -> None:
    click.echo(jsondoc.dumps(doc, indent=2, sort_keys=True, default=str))


def _figures_table(summary: dict[str, Any]) -> Table:
    table = Table(title=f"lcache bench: {printable(summary.get('workload', ''))} on "
                  f"{summary.get('num_accelerators', 1)} rank(s)")
    table.add_column("metric (DLIO key)")
    table.add_column("value", justify="right")
    for key, value in summary.get("metric", {}).items():
        if isinstance(value, list):
            shown = ", ".join(f"{v:.2f}" for v in value)
        elif isinstance(value, float):
            shown = f"{value:,.3f}"
        else:
            shown = str(value)
        table.add_row(printable(key), printable(shown))
    return table


def _epoch_table(summary: dict[str, Any]) -> Table:
    table = Table(title="per epoch (AU: mean over ranks; samples/s: sum over ranks)")
    for col in ("epoch", "AU %", "samples/s", "slowest rank samples/s", "measured MiB/s",
                "seconds"):
        table.add_column(col, justify="right")
    for row in summary.get("per_epoch", []):
        table.add_row(str(row["epoch"]), f"{row['au_percentage']:.2f}",
                      f"{row['throughput_samples_per_second']:,.1f}",
                      f"{row['min_rank_throughput_samples_per_second']:,.1f}",
                      f"{row['measured_io_MB_per_second']:,.1f}", f"{row['duration_s']:.2f}")
    return table


# What the two read rates mean (docs/bench.md, "Metrics").
_RATES = ("[dim]train_io_mean_MB_per_second = samples/s x record_length (DLIO's formula, the "
          "nominal size); measured MiB/s (train_io_measured_mean_MB_per_second) = the bytes the "
          "measured steps' batches read / their time: they differ when samples are not "
          "record_length bytes (record_length_stdev, file headers, whole-file reads)[/]")


def _print(summary: dict[str, Any], as_json: bool) -> None:
    if "metric" not in summary:
        return  # ranks other than 0 print nothing; rank 0 holds the merged summary
    if as_json:
        _emit_json(summary)
        return
    console.print(_figures_table(summary))
    if summary.get("per_epoch"):
        console.print(_epoch_table(summary))
        console.print(_RATES, highlight=False)
    for note in summary.get("notes", []):
        console.print(f"[dim]note: {printable(note)}[/]", highlight=False)
    summary_path = os.path.join(summary["output_folder"], "summary.json")
    console.print(f"summary: {printable(summary_path)}", highlight=False,
                  soft_wrap=True)  # one line to copy, however long the path
    met = "NOT MET" not in summary["verdict"]
    console.print(f"[bold {'green' if met else 'red'}]verdict:[/] "
                  f"{printable(summary['verdict'])}",
                  highlight=False)


@click.group()
def bench() -> None:
    """Benchmark storage with DLIO workloads (AU, samples/s, checkpoint GiB/s)."""


@bench.command("run")
@click.argument("config")
@click.option("--data-dir", type=Folder(), default=None,
              help="Dataset folder (default: the workload's dataset.data_folder).")
@click.option("--output", type=Folder(), default=None,
              help="Where summary.json goes (default: output.folder).")
@click.option("--checkpoint-dir", type=Folder(), default=None,
              help="Checkpoint folder (default: checkpoint.checkpoint_folder).")
@click.option("--generate/--no-generate", default=None,
              help="Generate the dataset first (default: workflow.generate_data).")
@click.option("--drop-cache", is_flag=True,
              help="Evict the dataset's pages before each epoch and checkpoints' before "
                   "reading, so storage is measured, not memory.")
@click.option("--odirect/--no-odirect", default=None,
              help="Read the dataset with O_DIRECT (default: reader.odirect).")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override a workload key, e.g. --set train.epochs=2 (DLIO: ++workload.*).")
@click.option("--trace", is_flag=True,
              help="Record the run's I/O with lcache's tracer and write report.html beside "
                   "summary.json.")
@click.option("--offload-from", "offload_preset", default=None, metavar="PRESET",
              help="Add the optimizer/activation offload traffic `lcache model PRESET` "
                   "predicts, scaled to this workload's computation_time.")
@click.option("--model-set", "model_settings", multiple=True, metavar="KEY=VALUE",
              help="lcache model setting for --offload-from, e.g. optimizer_offload=true.")
@click.option("--max-step-bytes", default="1GiB", show_default=True,
              help="Cap on one offload class's bytes per step per node.")
@click.option("--order", type=click.Choice(["dlio", "shuffle"]), default="dlio",
              show_default=True,
              help="Sample order: DLIO's (each rank reads its block as DLIO's loader does) or "
                   "shuffle (a global permutation per epoch, split over the ranks).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def run_cmd(config: str, data_dir: str | None, output: str | None,
            checkpoint_dir: str | None, generate: bool | None, drop_cache: bool,
            odirect: bool | None, overrides: tuple[str, ...], trace: bool,
            offload_preset: str | None, model_settings: tuple[str, ...],
            max_step_bytes: str, order: str, as_json: bool) -> None:
    """Run CONFIG (a DLIO workload YAML file, or a shipped name such as unet3d_h100).

    Under torchrun (`torchrun --nproc_per_node N -m lcache bench run ...`) each process is
    one emulated accelerator.
    """
    from lcache.bench import BenchOptions, load_workload, resolve_config, run_workload

    if not offload_preset:  # both are read only with --offload-from; alone, never checked
        ctx = click.get_current_context()
        for param, flag in (("model_settings", "--model-set"),
                            ("max_step_bytes", "--max-step-bytes")):
            if ctx.get_parameter_source(param) is not click.core.ParameterSource.DEFAULT:
                raise ConfigError(f"{flag} applies only to the offload traffic of "
                                  "--offload-from PRESET, which was not given; add it or drop "
                                  f"{flag}")
    w = load_workload(resolve_config(config), overrides)
    opts = BenchOptions(data_dir=data_dir, output=output, checkpoint_dir=checkpoint_dir,
                        generate=generate, drop_cache=drop_cache, direct=odirect, trace=trace,
                        show_progress=not as_json, order=order)
    offload: dict[str, Any] | None = None
    if offload_preset:
        from lcache.bench.from_model import offload_step_io
        from lcache.model import config_from_preset, predict
        from lcache.store import parse_size

        settings = _parse_settings(model_settings, "--model-set")
        pred = predict(config_from_preset(offload_preset, **settings)).to_dict()
        world = launch_rank_world()[1]
        opts.step_io, offload = offload_step_io(pred, w.computation_time, world,
                                                parse_size(max_step_bytes))
        offload["preset"] = offload_preset
    with UnwindOnTerminate():  # `timeout` left a partial checkpoint file behind
        summary = run_workload(w, opts)
    if offload is not None and "metric" in summary:
        summary["offload"] = offload
        capped = [c for c, v in offload["classes"].items() if v["capped"]]
        if capped:
            summary["verdict"] = (f"NOT MET: {', '.join(capped)} capped at "
                                  f"{max_step_bytes} per step, below what the model asks; "
                                  + summary["verdict"])
    _print(summary, as_json)


def _parse_settings(items: tuple[str, ...], option: str = "--set") -> dict[str, Any]:
    from lcache.bench.yamlfile import load_yaml

    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"{option} {item!r:.80} is not KEY=VALUE (e.g. {option} gpus=16)")
        out[key.replace("-", "_")] = load_yaml(raw, f"{option} {key:.80}")
    return out


@bench.command("from-model")
@click.argument("preset")
@click.option("--duration", default=30.0, show_default=True,
              help="Seconds one emulated checkpoint interval takes.")
@click.option("--steps", default=20, show_default=True, help="Emulated steps in it.")
@click.option("--dir", "directory", type=Folder(), required=True,
              help="A folder on the storage to measure (dataset, offload files, checkpoint).")
@click.option("--output", type=Folder(), default=None,
              help="Where summary.json goes (default: DIR/output).")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="lcache model setting, e.g. --set gpus=16 --set optimizer_offload=true.")
@click.option("--max-step-bytes", default="1GiB", show_default=True,
              help="Cap on one class's bytes per emulated step per node.")
@click.option("--restart", is_flag=True, help="Also read the checkpoint back.")
@click.option("--trace", is_flag=True, help="Record the run's I/O with lcache's tracer.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def from_model_cmd(preset: str, duration: float, steps: int, directory: str,
                   output: str | None, settings: tuple[str, ...], max_step_bytes: str,
                   restart: bool, trace: bool, as_json: bool) -> None:
    """Emulate the I/O `lcache model PRESET` predicts for one node, time-scaled to --duration.

    Time and bytes shrink by the same factor, so each class demands its real bandwidth.
    """
    from lcache.bench.from_model import run_from_model
    from lcache.store import parse_size

    with UnwindOnTerminate():
        summary = run_from_model(
            preset, duration, steps=steps, data_dir=os.path.join(directory, "data"),
            output=output or os.path.join(directory, "output"),
            max_step_bytes=parse_size(max_step_bytes), restart=restart,
            show_progress=not as_json, trace=trace, **_parse_settings(settings))
    if as_json or "from_model" not in summary:
        _print(summary, as_json)
        return
    info = summary["from_model"]
    if info["steps"] < steps:
        console.print(f"note: one checkpoint interval of {preset} is "
                      f"{info['checkpoint_interval_steps']} real steps; --steps {steps} "
                      f"emulates {info['steps']} (one per real step at most)",
                      highlight=False, soft_wrap=True)  # one line however long --steps is
    if info["duration_s"] < duration:
        console.print(f"note: one checkpoint interval of {preset} takes "
                      f"{info['duration_s']:.3g} s; --duration {duration:g} emulates that "
                      "(bytes and time are never scaled up)", highlight=False, soft_wrap=True)
    table = Table(title=f"{preset}: one checkpoint interval scaled by {info['scale']:.3g} into "
                  f"{info['duration_s']:.3g} s ({info['steps']} steps of "
                  f"{info['emulated_step_s']:.3f} s)")
    table.add_column("class")
    table.add_column("needs per node at full scale", justify="right")
    table.add_column("moved per emulated step", justify="right")
    for cls, row in info["classes"].items():
        need = (f"{row['required_MBps_per_node']:,.1f} MB/s" if "required_MBps_per_node" in row
                else f"{row['bytes_per_node'] / 2**30:,.2f} GiB per checkpoint")
        moved = row.get("emulated_bytes_per_step_per_node", row.get("emulated_bytes_per_node"))
        table.add_row(cls, need, f"{moved / 2**20:,.2f} MiB" + (" (capped)"
                                                                 if row.get("capped") else ""))
    console.print(table)
    _print(summary, as_json)


@bench.command("configs")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def configs_cmd(as_json: bool) -> None:
    """List the shipped DLIO workload configs (run one by name)."""
    from lcache.bench import load_workload, shipped_configs

    rows = []
    for name, path in shipped_configs().items():
        w = load_workload(path)
        data = w.do_train or w.generate_data  # a checkpoint-only file has no dataset
        rows.append({"name": name, "path": path, "model": w.model_name,
                     "format": w.format if data else "-",
                     "train": w.do_train, "checkpoint": w.do_checkpoint,
                     "computation_time": w.computation_time, "batch_size": w.batch_size,
                     "au": w.au})
    if as_json:
        _emit_json(rows)
        return
    table = Table(title="shipped DLIO workloads (lcache bench run NAME)")
    # short headers, so the names are not cut on an 80-column terminal
    for col in ("name", "model", "format", "train", "ckpt", "compute s", "batch", "AU"):
        table.add_column(col, no_wrap=col == "name")
    for r in rows:
        table.add_row(*(printable(r[c]) for c in ("name", "model", "format", "train", "checkpoint",
                                             "computation_time", "batch_size", "au")))
    console.print(table)
