"""``lcache`` subcommands. Thin: every figure comes from a library call."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import sys
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.table import Table

from lcache import __version__, jsondoc
from lcache.checks import printable
from lcache.cli.advise import advise_cmd
from lcache.cli.bench import bench
from lcache.cli.checks import Folder, number_option
from lcache.cli.ckpt import ckpt
from lcache.cli.model import model_cmd
from lcache.cli.trace import report_cmd, trace_cmd
from lcache.errors import ConfigError, CorruptionError, LCacheError
from lcache.store import Store, format_size, fsck, parse_size
from lcache.store.counters import read_totals
from lcache.terminate import UnwindOnTerminate

console = Console()
err_console = Console(stderr=True)

_SIZE_KEYS = {"capacity", "segment_size", "bytes_on_disk", "index_bytes", "bytes_read",
              "dataset_bytes", "fetched_bytes",
              "bytes_written", "gc_bytes_copied"}


def _emit_json(doc: Any) -> None:
    click.echo(jsondoc.dumps(doc, indent=2, sort_keys=True))


def _table(title: str, rows: dict[str, Any]) -> Table:
    table = Table(title=printable(title), show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for key, value in rows.items():
        shown = format_size(value) if key in _SIZE_KEYS and isinstance(value, int) else value
        table.add_row(printable(key), printable(str(shown)))
    return table


class _Group(click.Group):
    """Turns bad input (an LCacheError, an OSError such as a missing output directory, or
    a usage error click found) into one clear line and exit status 2, never a traceback."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        try:
            code = super().main(*args, **kwargs)
        except click.UsageError as exc:  # click prints usage, a hint, a blank line and this
            where = exc.ctx.command_path if exc.ctx is not None else "lcache"
            _error(f"{' '.join(exc.format_message().split())} (see `{where} --help`)")
        except click.ClickException as exc:
            _error(" ".join(exc.format_message().split()), exc.exit_code)
        except click.Abort as exc:
            err_console.print("Aborted!", highlight=False)
            # Ctrl-C: 128 + SIGINT, as shells report it (scripts tell it from a failure)
            sys.exit(130 if isinstance(exc.__context__, KeyboardInterrupt) else 1)
        if isinstance(code, int) and code:  # ctx.exit(code)
            sys.exit(code)
        return code

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (LCacheError, OSError) as exc:
            _error(_one_line(exc))


class _Failed(click.ClickException):
    """A failure said in one line, exit status 2 (like an LCacheError)."""

    exit_code = 2


def _error(line: str, code: int = 2) -> NoReturn:
    # soft_wrap: one line however long the paths in it (rich wraps at 80 columns)
    # escaped: a path such as "data[1]" or "x[/]y" is text, not markup
    err_console.print(f"[bold red]error:[/] {printable(line)}", highlight=False, soft_wrap=True)
    sys.exit(code)


#: errors that only writing gives
_WRITE_ERRNOS = {errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and not isinstance(exc, LCacheError) and exc.strerror:
        reason = exc.strerror[:1].lower() + exc.strerror[1:]
        name = exc.filename2 if exc.filename2 is not None else exc.filename
        if name is None:
            return reason
        path = os.fsdecode(name)
        # an atomic write goes through NAME.tmpPID: name the file the user asked for
        temp = re.fullmatch(r"(.+)\.tmp\d+", path)
        written = temp is not None or exc.errno in _WRITE_ERRNOS
        path = temp.group(1) if temp else path
        return f"cannot {'write' if written else 'access'} {path}: {reason}"
    return " ".join(str(exc).split()) or type(exc).__name__


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="lcache")
@click.option("-v", "--verbose", is_flag=True, help="Log what lcache does (warnings always).")
def cli(verbose: bool) -> None:
    """LCache: the storage side of deep-learning training on local NVMe SSD."""
    from lcache.trace import recorder

    if recorder.env_error is not None:  # said in one line when lcache was imported
        sys.exit(2)
    handler = logging.StreamHandler()
    handler.setFormatter(_NamedOnce("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, handlers=[handler])


class _NamedOnce(logging.Formatter):
    """``LEVEL logger: message``, the logger named once: lcache's messages start with
    "lcache: " (for programs that log without a format), and read "lcache: lcache: " here."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        doubled = f" {record.name}: {record.name}: "
        return text.replace(doubled, doubled[: len(record.name) + 3], 1)


def _store_summary(directory: str) -> dict[str, Any]:
    with Store.open(directory, create=False) as store:
        structure = store.stats()
    for key in list(structure):
        if key not in ("path", "capacity", "segment_size", "policy", "bytes_on_disk",
                       "segments", "active_segments", "live_keys", "index_bytes"):
            del structure[key]
    return {**structure, "totals": read_totals(structure["path"]).as_dict()}


@cli.command()
@click.argument("directory", type=Folder())
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def stats(directory: str, as_json: bool) -> None:
    """Show a sample cache's or a store's size, keys and counters (all processes)."""
    from lcache.data.identity import read_cache_json

    raw = read_cache_json(directory)  # refuses a FIFO or a device there
    if raw is not None:
        _cache_stats(directory, _cache_identity(os.path.join(directory, "cache.json"), raw),
                     as_json)
        return
    doc = _store_summary(directory)
    if as_json:
        _emit_json(doc)
        return
    totals = doc.pop("totals")
    console.print(_table(f"lcache store {directory}", doc))
    console.print(_table("counters (all processes, as of their last flush/close)", totals))


def _cache_identity(path: str, raw: bytes) -> dict[str, Any]:
    """The cache's identity (``raw``, read from ``path``), or a CorruptionError saying what
    is wrong with it."""
    try:
        doc = jsondoc.loads(raw)
    except ValueError:
        doc = None
    if not (isinstance(doc, dict) and isinstance(doc.get("source"), str)
            and isinstance(doc.get("samples"), int)):
        raise CorruptionError(f"{path} is damaged (not the JSON lcache writes there); opening "
                              "the cache with CachedDataset drops its samples and starts anew")
    return doc


def _cache_stats(directory: str, source: dict[str, Any], as_json: bool) -> None:
    from lcache.data.shared import SharedCounters

    counters = SharedCounters(os.path.join(directory, "counters.bin")).totals()
    # as ds.stats() gives them: the fetches a reader waited for (not warm's or prefetches)
    counters["demand_misses"] = counters["fetches"] - counters["prefetched"]
    accesses = counters["accesses"]
    store = _store_summary(os.path.join(directory, "store"))
    doc = {
        "source": source["source"], "samples": source["samples"],
        # null before any read (a cache only warmed); 0 when fetches exceed accesses
        "hit_ratio": round(max(0.0, 1 - counters["fetches"] / accesses), 4) if accesses
        else None,
        "counters": counters, "store": store,
    }
    if as_json:
        _emit_json(doc)
        return
    head = {"source": doc["source"], "samples": doc["samples"],
            "hit_ratio (all time)": "no reads yet" if doc["hit_ratio"] is None
            else doc["hit_ratio"],
            "capacity": store["capacity"], "bytes_on_disk": store["bytes_on_disk"],
            "cached samples": store["live_keys"]}
    console.print(_table(f"lcache sample cache {directory}", head))
    console.print(_table("accesses and fetches (all processes, all time)", {
        k: format_size(v) if k.endswith("bytes") else v for k, v in counters.items()}))


@cli.command()
@click.argument("source")
@click.option("--cache", "cache_dir", required=True, type=Folder(),
              help="The cache directory (on the local SSD).")
@click.option("--capacity", default="50GB", show_default=True,
              help="Bound on the cache's bytes on disk.")
@click.option("--threads", default=16, show_default=True, type=click.IntRange(1, 1024),
              help="Fetches in flight.")
@click.option("--segment-size", default=None,
              help="A new cache's segment size, as CachedDataset(segment_size=) takes it "
                   "(default: sized from the capacity; a small cache may need a smaller one).")
@click.option("-o", "--option", "options", multiple=True, metavar="KEY=VALUE",
              help="fsspec storage option, e.g. -o endpoint_url=http://127.0.0.1:9000; "
                   "VALUE true or false (any case) is a boolean, null None, a plain decimal "
                   "number (8, 1.5; no leading zero) a number, JSON starting with {, [ or \" "
                   "a mapping, a list or a string (-o 'key=\"123\"'), anything else the "
                   "string as given.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def warm(source: str, cache_dir: str, capacity: str, threads: int, segment_size: str | None,
         options: tuple[str, ...], as_json: bool) -> None:
    """Fetch SOURCE's files (in path order) into the cache until it is full: a cache of
    plain files, as CachedDataset(SOURCE, ...) opens it (docs/cache.md)."""
    from lcache.data.sizing import cache_capacity
    from lcache.data.warm import warm_cache

    try:  # before the source is listed (a full listing on S3): a size or a percentage
        cache_capacity(capacity, 1)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--capacity") from None
    if segment_size is not None:
        try:
            parse_size(segment_size, "segment_size")
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--segment-size") from None
    storage_options = {}
    for item in options:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--option")
        if key in storage_options:
            raise click.BadParameter(f"{key!r} is given twice", param_hint="--option")
        storage_options[key] = _option_value(value)
    try:
        with UnwindOnTerminate():  # `timeout` left its staging area in /dev/shm
            figures = warm_cache(source, cache_dir, capacity, threads=threads,
                                 storage_options=storage_options, show_progress=not as_json,
                                 segment_size=segment_size)
    except OSError as exc:
        if isinstance(exc, LCacheError) or exc.filename is not None:
            raise
        # no file named (a host that does not resolve, a refused connection): name the URL
        raise _Failed(f"cannot read {source}: {_one_line(exc)}") from None
    if as_json:
        _emit_json(figures)
    else:
        console.print(_table(f"lcache warm {source}", figures))



def _option_value(text: str) -> Any:
    """A ``-o KEY=VALUE`` value typed as fsspec's keyword arguments are: the string "false"
    is true to s3fs (-o anon=false signed nothing). Only plain booleans, null and decimal
    numbers are typed; the rest stays the string given: read as YAML, a secret "0777" became
    511, "abc #def" lost its end, "12:30" became 750 (attack round 21). JSON for what needs
    it: a mapping (``headers``, ``client_kwargs``), a list, a string of digits."""
    if text[:1] in ('{', '[', '"'):
        try:
            return json.loads(text)
        except ValueError as exc:
            raise click.BadParameter(f"{text!r:.80} is not JSON: {exc}",
                                     param_hint="--option") from None
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text == "null":
        return None
    if re.fullmatch(r"-?(0|[1-9][0-9]*)", text):
        return int(text)
    if re.fullmatch(r"-?(0|[1-9][0-9]*)\.[0-9]+", text):
        return float(text)
    return text

@cli.command("fsck")
@click.argument("directory", type=Folder())
@click.option("--repair", is_flag=True, help="Fix what can be fixed (bad records become misses).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def fsck_cmd(directory: str, repair: bool, as_json: bool) -> None:
    """Check a store (a sample cache's: DIR/store); exit status 0 when clean, 2 when
    problems remain."""
    from lcache.data.identity import read_cache_json

    if read_cache_json(directory) is not None:  # a sample cache, as `lcache stats` reads it
        directory = os.path.join(directory, "store")
        if not as_json:
            console.print(f"sample cache: checking its store {printable(directory)}",
                          highlight=False)
    report = fsck(directory, repair=repair)
    if as_json:
        _emit_json(report.to_dict())
    else:
        console.print(
            f"{report.segments} segments ({report.active_segments} active), "
            f"{report.records} records, {report.indexed_keys} indexed keys",
            highlight=False,
        )
        for text in report.repaired:
            console.print(f"[green]repaired:[/] {printable(text)}", highlight=False)
        for text in report.problems:
            console.print(f"[red]problem:[/] {printable(text)}", highlight=False)
        console.print("[bold green]clean[/]" if report.clean else "[bold red]NOT clean[/]")
    sys.exit(0 if report.clean else 2)


@cli.command()
@click.option("--dir", "directory", type=Folder(), default=None,
              help="Where to put the remote's files and the cache (default: a temporary "
                   "directory).")
@click.option("--samples", default=4000, show_default=True, type=click.IntRange(1, 10**7),
              help="Samples in the dataset.")
@click.option("--sample-size", default="16KiB", show_default=True, help="Bytes per sample.")
@click.option("--cache-fraction", default=0.5, show_default=True,
              callback=number_option("--cache-fraction", float, 0.001, 1.0),
              help="Cache capacity as a fraction of the dataset (0.001 to 1).")
@click.option("--epochs", default=3, show_default=True, type=click.IntRange(1, 1000))
@click.option("--latency", default=0.005, show_default=True,
              callback=number_option("--latency", float, 0.0, 10.0),
              help="Seconds the remote waits before each response (0 to 10).")
@click.option("--bandwidth", default="25MB", show_default=True,
              help="The remote's bandwidth cap, per second.")
@click.option("--workers", default=2, show_default=True, type=click.IntRange(0, 64),
              help="DataLoader workers.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def demo(directory: str | None, samples: int, sample_size: str, cache_fraction: float,
         epochs: int, latency: float, bandwidth: str, workers: int, as_json: bool) -> None:
    """Train a small model on a throttled loopback remote, with and without the cache."""
    from lcache.demo import run_training_demo

    progress = (lambda s: None) if as_json else \
        (lambda s: err_console.print(f"[dim]{printable(s)}[/]", highlight=False,
                                     soft_wrap=True))
    with UnwindOnTerminate():  # `timeout` left its folders and DataLoader workers behind
        figures = run_training_demo(
            directory, samples=samples, sample_bytes=parse_size(sample_size),
            cache_fraction=cache_fraction, epochs=epochs, latency=latency,
            bandwidth=parse_size(bandwidth), workers=workers, progress=progress)
    if as_json:
        _emit_json(figures)
        return
    table = Table(title=(
        f"{samples} x {format_size(figures['sample_bytes'])} samples "
        f"({format_size(figures['dataset_bytes'])}) on a remote with {latency * 1000:g} ms "
        f"latency and {format_size(figures['remote']['bandwidth_Bps'])}/s; "
        f"cache = {cache_fraction:g} x dataset"))
    for col in ("system", "epoch", "seconds", "samples/s", "remote MiB", "hit ratio",
                "OPT hit ratio"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for row in figures["epochs"]:
        table.add_row(row["system"], str(row["epoch"]), f"{row['seconds']:.2f}",
                      f"{row['samples_per_s']:,.0f}", f"{row['remote_bytes'] / 2**20:,.1f}",
                      f"{row['hit_ratio']:.3f}", str(row.get("opt_hit_ratio", "-")))
    console.print(table)


@cli.command("store-demo")
@click.option("--dir", "directory", type=Folder(), default=None,
              help="Where to put the demo store (default: a temporary directory).")
@click.option("--samples", default=8000, show_default=True, type=click.IntRange(1, 10**7),
              help="Samples to write.")
@click.option("--sample-size", default="16KiB", show_default=True, help="Bytes per sample.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def store_demo(directory: str | None, samples: int, sample_size: str, as_json: bool) -> None:
    """Write, read, crash a writer with kill -9 and recover, printing figures."""
    from lcache.store_demo import run_store_demo

    with UnwindOnTerminate():  # its temporary folder goes too
        figures = run_store_demo(directory, samples, sample_size, show_progress=not as_json)
    if as_json:
        _emit_json(figures)
    else:
        console.print(_table("lcache store demo", figures))


def main() -> None:
    cli(prog_name="lcache")


# The subcommands that live in their own modules.
for _command in (model_cmd, ckpt, trace_cmd, report_cmd, bench, advise_cmd):
    cli.add_command(_command)
