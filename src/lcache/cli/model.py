"""``lcache model``: what a training configuration asks of storage (thin over lcache.model)."""

from __future__ import annotations

import math
import re
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from lcache import jsondoc
from lcache.checks import printable
from lcache.errors import ConfigError
from lcache.model import PRESETS, config_from_preset, get_preset, load_model_file, predict
from lcache.store.layout import format_decimal_size, parse_size

console = Console()

# CLI option -> TrainingConfig field (or shape field), for the options given on the command line.
_OPTION_FIELDS = {
    "gpus": "gpus", "gpu": "gpu", "mfu": "mfu", "global_batch": "global_batch",
    "micro_batch": "micro_batch", "seq_len": "seq_len", "precision": "precision",
    "optimizer_dtype": "optimizer_state_dtype", "tp": "tp", "pp": "pp", "dp": "dp",
    "zero": "zero_stage", "recompute": "recompute", "ckpt_steps": "checkpoint_interval_steps",
    "ckpt_minutes": "checkpoint_interval_minutes", "retention": "retention",
    "activation_offload": "activation_offload", "optimizer_offload": "optimizer_offload",
    "bytes_per_token": "bytes_per_token", "gpus_per_node": "gpus_per_node",
    "ssds_per_node": "ssds_per_node", "ssd_dwpd": "ssd_rated_dwpd",
    "restarts_per_day": "restarts_per_day", "restart_budget": "restart_budget_s",
    "max_stall": "max_stall_fraction",
}
_SIZE_OPTIONS = {"ssd_capacity": "ssd_capacity_bytes", "ssd_write": "ssd_write_bytes_per_s",
                 "ssd_read": "ssd_read_bytes_per_s"}
_OTHER_OPTIONS = {"peak_tflops": "peak_flops", "hbm": "hbm_bytes"}


def _name_options(exc: ConfigError, given: dict[str, Any]) -> ConfigError:
    """``exc`` with the command-line options (as typed) behind the settings it names, so
    ``--peak-tflops 1e308`` is named rather than only ``peak_flops`` = inf."""
    text = str(exc)
    named = []
    for opt, fld in {**_OPTION_FIELDS, **_SIZE_OPTIONS, **_OTHER_OPTIONS}.items():
        flag = "--" + opt.replace("_", "-")
        if opt in given and re.search(rf"\b{fld}\b", text) and flag not in text:
            named.append(f"{flag} {given[opt]}")
    return ConfigError(f"{text} (given as {', '.join(named)})") if named else exc


def _num(x: float) -> str:
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}"


def both_units(n: float) -> str:
    """``112.4 GB (104.7 GiB)``: decimal and binary, so nobody has to guess which."""
    if not n:
        return "0"
    dec, bin_ = format_decimal_size(n), ""
    for i, unit in enumerate(("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")):
        if abs(n) < 1024 ** (i + 1) or unit == "EiB":
            bin_ = f"{_num(n / 1024**i)} {unit}" if i else f"{n:.0f} B"
            break
    return dec if dec == bin_ else f"{dec} ({bin_})"


def _rate(mbps: float) -> str:
    if not mbps:
        return "0"
    if mbps >= 1000:
        return f"{mbps / 1000:,.1f} GB/s"
    return f"{mbps:,.1f} MB/s" if mbps >= 1 else f"{mbps:.3f} MB/s"


def _finite(doc: Any) -> Any:
    """JSON has no infinity: ratios with nothing to compare become null."""
    if isinstance(doc, dict):
        return {k: _finite(v) for k, v in doc.items()}
    if isinstance(doc, float) and not math.isfinite(doc):
        return None
    return doc


def _print_tables(doc: dict[str, Any]) -> None:
    cfg = doc["config"]
    mem = doc["memory"]
    name = printable(doc["model"])  # from a model file
    head = Table(title=f"lcache model {name}: {doc['gpus']} x {printable(cfg['gpu'])} "
                       f"({doc['nodes']} nodes), TP{cfg['tp']} PP{cfg['pp']} DP{doc['dp']} "
                       f"ZeRO-{cfg['zero_stage']}, MFU {cfg['mfu']:.0%}", show_header=False)
    head.add_column(style="bold")
    head.add_column(justify="right")
    rows = {
        "parameters": f"{doc['params']:,} ({doc['params'] / 1e9:.2f} B)",
        "training FLOPs per token": f"{doc['flops_per_token']:.3e}",
        "tokens per step": f"{doc['tokens_per_step']:,}",
        "step time": f"{doc['step_time_s']:.3f} s",
        "checkpoint (global)": f"{both_units(doc['checkpoint_bytes'])} = params x "
                               f"{doc['checkpoint_bytes_per_param']} B",
        "checkpoint per node / per GPU": f"{both_units(doc['checkpoint_bytes_per_node'])} / "
                                         f"{both_units(doc['checkpoint_bytes_per_gpu'])}",
        "checkpoint interval": f"{doc['checkpoint_interval_steps']} steps = "
                               f"{doc['checkpoint_interval_s'] / 60:.1f} min",
        "model state in memory (global)": f"{both_units(mem['model_state_bytes'])} = params x "
                                          f"{mem['bytes_per_param']} B",
        "per-GPU memory (states + activations)": (
            f"{both_units(mem['per_gpu_bytes'])} of {both_units(mem['hbm_bytes'])} HBM: "
            + ("fits" if mem["fits"] else "[red]does not fit[/]")),
    }
    for key, value in rows.items():
        head.add_row(key, value)
    console.print(head)

    on = {name: c for name, c in doc["classes"].items() if c["enabled"]}
    off = [name for name, c in doc["classes"].items() if not c["enabled"]]
    table = Table(title="I/O per class: global bytes unless per node/GPU; MB/s = 1e6 B/s "
                        "per node", show_lines=True)
    table.add_column("")
    for name in on:
        table.add_column(name, justify="right")

    def row(label: str, cell: Any) -> None:
        table.add_row(label, *(cell(c) for c in on.values()))

    def size(n: float) -> str:
        return both_units(n).replace(" (", "\n(")

    row("direction", lambda c: c["direction"])
    def per_step(c: dict[str, Any]) -> str:
        if c["event"] == "step":
            return size(c["bytes_per_step"])
        if c["steps_per_event"] is None:  # the event never happens (0 restarts a day)
            return f"0\nnever: no {c['event']}"
        # none at most steps: the event's bytes spread over the steps between two events
        return (f"{size(c['amortized_bytes_per_step'])}\namortized: 1 {c['event']}\nper "
                f"{c['steps_per_event']:,.0f} steps")

    row("per step", per_step)
    row("per event", lambda c: size(c["bytes_per_event"]) + f"\nper {c['event']}")
    row("per day", lambda c: size(c["bytes_per_day"]))
    row("per node per day", lambda c: size(c["per_node_bytes_per_day"]))
    row("per GPU per day", lambda c: size(c["per_gpu_bytes_per_day"]))
    row("need, overlapped", lambda c: _rate(c["MBps_needed_overlap"]))
    row("need, not overlapped", lambda c: _rate(c["MBps_needed_no_overlap"]))
    console.print(table)
    if off:
        console.print(f"[dim]off: {', '.join(off)}[/]", highlight=False)

    ssd = doc["ssd"]
    tail = Table(title=f"SSDs per node: {ssd['ssds_per_node']} x "
                       f"{both_units(cfg['ssd_capacity_bytes'])}", show_header=False)
    tail.add_column(style="bold")
    tail.add_column(justify="right")
    tail.add_row("written per node per day", both_units(ssd["write_bytes_per_day_per_node"]))
    tail.add_row("drive writes per day", f"{ssd['dwpd']:.3f} (rated {ssd['rated_dwpd']:g})")
    tail.add_row("write need / available", f"{_rate(ssd['write_MBps_needed_per_node'])} / "
                                           f"{_rate(ssd['write_MBps_available_per_node'])}")
    tail.add_row("read need / available", f"{_rate(ssd['read_MBps_needed_per_node'])} / "
                                          f"{_rate(ssd['read_MBps_available_per_node'])}")
    tail.add_row("restart read need", _rate(ssd["restart_read_MBps_needed_per_node"]))
    tail.add_row("held / capacity", f"{both_units(ssd['bytes_held_per_node'])} / "
                                    f"{both_units(ssd['capacity_bytes_per_node'])}")
    console.print(tail)
    colour = "green" if ssd["keeps_up"] and ssd["endurance_ok"] else "red"
    console.print(f"[bold {colour}]verdict:[/] {ssd['verdict']}", highlight=False)


@click.command("model")
@click.argument("preset", required=False)
@click.option("--model-file", type=click.Path(dir_okay=False), default=None,
              help="YAML model file (layers, hidden, ffn_hidden, heads, kv_heads, vocab, "
                   "seq_len; optional preset: and training:).")
@click.option("--gpus", type=int, help="GPUs in the job.")
@click.option("--gpu", type=click.Choice(["h100", "h200", "a100"]), help="GPU kind.")
@click.option("--peak-tflops", type=float, help="Dense peak TFLOP/s per GPU (instead of --gpu).")
@click.option("--hbm", "hbm", help="GPU memory, e.g. 80GB (instead of --gpu's).")
@click.option("--mfu", type=float, help="Model FLOP utilisation, 0-1.")
@click.option("--global-batch", type=int, help="Sequences per optimizer step.")
@click.option("--micro-batch", type=int, help="Sequences per GPU per pass.")
@click.option("--seq-len", type=int, help="Tokens per sequence.")
@click.option("--precision", type=click.Choice(["bf16", "fp8"]), help="Compute precision.")
@click.option("--optimizer-dtype", type=click.Choice(["fp32", "bf16"]),
              help="dtype of Adam's m and v.")
@click.option("--tp", type=int, help="Tensor-parallel size.")
@click.option("--pp", type=int, help="Pipeline-parallel size.")
@click.option("--dp", type=int, help="Data-parallel size (default gpus / (tp x pp)).")
@click.option("--zero", type=click.IntRange(0, 3), help="ZeRO stage.")
@click.option("--recompute", type=click.Choice(["none", "selective", "full"]),
              help="Activation recomputation.")
@click.option("--ckpt-steps", type=int, help="Steps between checkpoints.")
@click.option("--ckpt-minutes", type=float, help="Minutes between checkpoints (default 30).")
@click.option("--retention", type=int, help="Checkpoints kept on the node's SSDs.")
@click.option("--activation-offload/--no-activation-offload", default=None,
              help="Offload activations to SSD.")
@click.option("--optimizer-offload/--no-optimizer-offload", default=None,
              help="Keep optimizer state on SSD.")
@click.option("--bytes-per-token", type=int, help="Dataset bytes per token on disk.")
@click.option("--gpus-per-node", type=int, help="GPUs per node.")
@click.option("--ssds-per-node", type=int, help="NVMe drives per node.")
@click.option("--ssd-capacity", help="Capacity of one drive, e.g. 3.84TB.")
@click.option("--ssd-write", help="Write bandwidth of one drive per second, e.g. 3.8GB.")
@click.option("--ssd-read", help="Read bandwidth of one drive per second, e.g. 7GB.")
@click.option("--ssd-dwpd", type=float, help="Rated drive writes per day.")
@click.option("--restarts-per-day", type=float, help="Restarts (checkpoint loads) per day.")
@click.option("--restart-budget", type=float,
              help="Seconds a restart may take to load (x restarts per day: a day at most).")
@click.option("--max-stall", type=float,
              help="Share of time, below 1, GPUs may wait on I/O that is not overlapped "
                   "(default 0.05).")
@click.option("--list", "list_presets", is_flag=True, help="List the presets and exit.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def model_cmd(preset: str | None, model_file: str | None, peak_tflops: float | None,
              hbm: str | None, list_presets: bool, as_json: bool, **options: Any) -> None:
    """Predict what training PRESET (or --model-file) asks of storage, per I/O class.

    Presets: llama3-8b, llama3-70b, llama3-405b, gpt3-175b, bert-large. Sizes print in both
    GB and GiB; bandwidths in MB/s = 1e6 B/s, per node.
    """
    if list_presets:
        rows = {name: {k: v for k, v in shape.to_dict().items() if k != "name"}
                for name, shape in PRESETS.items()}
        if as_json:
            click.echo(jsondoc.dumps(rows, indent=2, sort_keys=True))
        else:
            for name, shape in PRESETS.items():
                console.print(f"[bold]{name}[/]: {shape.layers} layers, hidden {shape.hidden}, "
                              f"ffn {shape.ffn_hidden}, {shape.heads} heads "
                              f"({shape.kv_heads} kv), vocab {shape.vocab}, seq {shape.seq_len}"
                              f" -- {shape.source}", highlight=False)
        return
    if (preset is None) == (model_file is None):
        raise ConfigError("give a preset (" + ", ".join(PRESETS) + ") or --model-file, "
                          "exactly one")
    overrides = {_OPTION_FIELDS[k]: v for k, v in options.items()
                 if k in _OPTION_FIELDS and v is not None}
    for opt, fld in _SIZE_OPTIONS.items():
        if options.get(opt) is not None:
            overrides[fld] = parse_size(options[opt])
    if peak_tflops is not None:
        overrides["peak_flops"] = peak_tflops * 1e12
    if hbm is not None:
        overrides["hbm_bytes"] = parse_size(hbm)
    if preset is not None:
        get_preset(str(preset), alternative="a model file (--model-file)")
    try:
        cfg = load_model_file(model_file, **overrides) if model_file else \
            config_from_preset(str(preset), **overrides)
        doc = _finite(predict(cfg).to_dict())
    except ConfigError as exc:
        given = {k: v for k, v in options.items() if v is not None}
        given.update({k: v for k, v in (("peak_tflops", peak_tflops), ("hbm", hbm))
                      if v is not None})
        raise _name_options(exc, given) from None
    if as_json:
        click.echo(jsondoc.dumps(doc, indent=2, sort_keys=True))
    else:
        _print_tables(doc)
