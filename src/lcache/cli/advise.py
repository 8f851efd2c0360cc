"""``lcache advise TRACE...``: fit a trace, emit a DLIO workload, scale, check and advise."""

from __future__ import annotations

from typing import Any

import click
from rich.console import Console

from lcache import jsondoc
from lcache.checks import printable
from lcache.cli.checks import STDOUT, check_outputs, check_replaceable, number, output_option
from lcache.errors import ConfigError
from lcache.model.config import MAX_COUNT
from lcache.store.layout import parse_size

console = Console()


class _OneLineErrors(click.Command):
    """Bad options are one line on stderr and exit status 2, like every lcache error (click
    would print its usage block)."""

    def make_context(self, info_name: str | None, args: list[str],
                     parent: click.Context | None = None, **extra: Any) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as exc:
            raise ConfigError(f"lcache advise: {exc.format_message()} (see lcache advise "
                              "--help)") from None


@click.command("advise", cls=_OneLineErrors)
@click.argument("traces", nargs=-1)
@click.option("--scale-gpus", default=None, metavar="N",
              help="Scale the traced job to N GPUs (per GPU, per node, per day, DWPD).")
@click.option("--model", default=None, metavar="PRESET",
              help="lcache model preset of the target (llama3-70b...): the cluster's own I/O, "
                   "and whether optimizer offload fits.")
@click.option("--gpus-per-node", default="8", show_default=True)
@click.option("--traced-gpus", default=None, metavar="N",
              help="GPUs (ranks) the traces hold (default: one per trace file, or the "
                   "processes stepping together where more).")
@click.option("--storage", default=None, metavar="DIR",
              help="Run the emitted workload in DIR (an existing directory) and say per "
                   "class whether it keeps up.")
@click.option("--check-epochs", default="1", show_default=True,
              help="Epochs of the emitted workload that --storage runs (at most the "
                   "traced run's).")
@click.option("--hit-ratio", default="0.9", show_default=True,
              help="Target hit ratio of the sample cache.")
@click.option("--max-stall", default="0.05", show_default=True,
              help="Share of step time checkpoints may stall.")
@click.option("--ssds", default="8", show_default=True, help="SSDs per node.")
@click.option("--ssd-capacity", default="3.84TB", show_default=True, help="One SSD's size.")
@click.option("--ssd-write", default="3.8GB", show_default=True,
              help="One SSD's write bandwidth per second.")
@click.option("--ssd-read", default="7GB", show_default=True,
              help="One SSD's read bandwidth per second.")
@click.option("--rated-dwpd", default="1", show_default=True,
              help="Drive writes per day the SSDs are rated for.")
@output_option("--emit", "emit_path", what="workload file", metavar="FILE",
               help="Write the fitted DLIO workload YAML to FILE ('-' prints it alone on "
                    "stdout, the advice on stderr).")
@output_option("-o", "--output", "html_path", what="page", metavar="FILE",
               help="Write advice.html: the report's page with an Advice section.")
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON.")
def advise_cmd(traces: tuple[str, ...], scale_gpus: str | None, model: str | None,
               gpus_per_node: str, traced_gpus: str | None, storage: str | None, check_epochs: str,
               hit_ratio: str, max_stall: str, ssds: str, ssd_capacity: str, ssd_write: str,
               ssd_read: str, rated_dwpd: str, emit_path: str | None, html_path: str | None,
               as_json: bool) -> None:
    """Advise on storage from TRACE (files `lcache trace` or LCACHE_TRACE wrote).

    Fits steps, per-class bytes per step, request sizes, mix and concurrency; emits a DLIO
    workload that reproduces them; advises cache capacity, reader threads and prefetch, the
    checkpoint interval and optimizer offload, with the arithmetic behind each figure.
    """
    from lcache.advise import Targets, advise
    from lcache.advise.emit import is_workload_yaml
    from lcache.advise.page import is_advice_page
    from lcache.io import atomic_write

    if not traces:
        raise ConfigError("lcache advise: give a trace file (lcache trace -o FILE -- CMD "
                          "writes one)")
    t = Targets(hit_ratio=number(hit_ratio, "--hit-ratio", float, 0.001, 1.0),
                max_stall=number(max_stall, "--max-stall", float, 0.0001, 0.99),
                ssd_write_Bps=parse_size(ssd_write), ssd_read_Bps=parse_size(ssd_read),
                ssd_capacity_bytes=parse_size(ssd_capacity),
                ssds=number(ssds, "--ssds", int, 1, 1024),
                rated_dwpd=number(rated_dwpd, "--rated-dwpd", float, 0.001, 1000.0))
    gpus = None if scale_gpus is None else \
        number(scale_gpus, "--scale-gpus", int, 1, MAX_COUNT["gpus"])  # as lcache model
    check_outputs([("--json", STDOUT if as_json else None, "advice", True),
                   ("--emit", emit_path, "workload", True), ("-o", html_path, "page", False)],
                  traces)
    # each replaces only a file of its kind lcache wrote, never a user's file of that name
    check_replaceable([("--emit", emit_path, "workload file", is_workload_yaml),
                       ("-o", html_path, "advice page", is_advice_page)])
    doc = advise(list(traces), t, scale_gpus=gpus, model=model,
                 gpus_per_node=number(gpus_per_node, "--gpus-per-node", int, 1, 1024),
                 traced_gpus=None if traced_gpus is None else number(
                     traced_gpus, "--traced-gpus", int, 1, 1 << 24),
                 storage=storage,
                 check_epochs=number(check_epochs, "--check-epochs", int, 1, 1000),
                 html_path=html_path, show_progress=not as_json)
    yaml = doc["workload"]["yaml"]
    if emit_path not in (None, STDOUT):
        atomic_write(emit_path, yaml.encode(), mode=0o644)
    if as_json:
        click.echo(jsondoc.dumps(doc, indent=2, sort_keys=True, default=str))
    elif emit_path == STDOUT:  # stdout holds the YAML alone; the advice goes to stderr
        _print(doc, emit_path, html_path, Console(stderr=True))
        click.echo(yaml, nl=not yaml.endswith("\n"))
    else:
        _print(doc, emit_path, html_path, console)


def _print(doc: dict[str, Any], emit_path: str | None, html_path: str | None,
           console: Console) -> None:
    # Lines, not a table: the arithmetic is a sentence that a narrow column would shred.
    for a in doc["advice"]:
        if "missing" in a:
            console.print(f"[bold]{a['topic']}[/]: [yellow]not fitted[/]: "
                          f"{printable(a['missing'])}",
                          highlight=False)
        else:
            console.print(f"[bold]{a['topic']}[/]: {a['figure']} = {a['value']}\n  "
                          f"{printable(a['arithmetic'])}", highlight=False)
    for u in doc["unfitted"]:
        if u["what"] == "check":  # --storage was given, and nothing runs: not a fit
            console.print(f"[yellow]no check:[/] {printable(u['why'])}", highlight=False)
        else:
            console.print(f"[yellow]not fitted:[/] {printable(u['what'])}: "
                          f"{printable(u['why'])}", highlight=False)
    if doc["check"]:
        for name, c in doc["check"]["classes"].items():
            console.print(f"[bold]check {name}[/]: "
                          f"{'keeps up' if c['keeps_up'] else 'does NOT keep up'} (margin "
                          f"{c['margin']:.2f}x): {printable(c['arithmetic'])}", highlight=False)
    # What is copied from here (the YAML, the paths) is written as is: console.print wrapped
    # it at the terminal's width (80 columns in a pipe), and a long path in the YAML's
    # comment went on to a line of its own that is no YAML; ``out`` neither wraps nor crops
    # nor reads markup or emoji codes.
    if emit_path == STDOUT:
        pass
    elif emit_path:
        console.out(f"workload: {emit_path}", highlight=False)
    else:
        yaml = doc["workload"]["yaml"]
        console.out(yaml, highlight=False, end="" if yaml.endswith("\n") else "\n")
    if html_path:
        console.out(f"advice page: {html_path}", highlight=False)
