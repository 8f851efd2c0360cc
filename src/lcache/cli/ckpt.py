"""``lcache ckpt ls DIR`` and ``lcache ckpt verify DIR``: list and check checkpoints."""

from __future__ import annotations

import datetime
import json
import os
import sys
from typing import Any

import click
from rich.console import Console
from rich.progress import DownloadColumn, Progress, TransferSpeedColumn
from rich.table import Table

from lcache import jsondoc
from lcache.checks import printable, shown
from lcache.cli.checks import Folder

console = Console()


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


@click.group("ckpt")
def ckpt() -> None:
    """List and verify lcache checkpoints."""


@ckpt.command("ls")
@click.argument("directory", type=Folder())
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def ls_cmd(directory: str, as_json: bool) -> None:
    """List the complete checkpoints in DIRECTORY, oldest first (partial saves and links
    never)."""
    from lcache.checkpoint import leftovers, list_checkpoints
    from lcache.checkpoint.format import MANIFEST
    from lcache.errors import ConfigError

    if os.path.lexists(os.path.join(directory, MANIFEST)):  # not an empty table, exit 0
        folder = os.path.dirname(os.path.abspath(directory))
        raise ConfigError(f"{directory} is a checkpoint; `lcache ckpt ls` lists the checkpoints "
                          f"in a folder: give {folder} (`lcache ckpt verify {directory}` checks "
                          "this one)")
    good, bad = list_checkpoints(directory)  # a missing directory: one line, exit status 2
    left = [os.path.basename(p) for p in leftovers(directory)]
    if as_json:
        click.echo(jsondoc.dumps({"checkpoints": [c.to_dict() for c in good], "damaged": bad,
                               "leftovers": left}, indent=2, sort_keys=True))
        return
    table = Table(title=f"checkpoints in {printable(directory)}")
    for col in ("name", "created (UTC)", "ranks", "arrays", "data", "meta"):
        table.add_column(col, justify="left" if col in ("name", "meta") else "right")
    for c in good:
        created = datetime.datetime.fromtimestamp(c.created_unix, datetime.timezone.utc)
        table.add_row(printable(c.name), created.strftime("%Y-%m-%d %H:%M:%S"), str(c.world_size),
                      str(c.arrays), _size(c.data_bytes),
                      printable(json.dumps(c.meta, sort_keys=True)) if c.meta else "")
    console.print(table)
    if bad:
        console.print(f"[red]damaged manifests (not listed):[/] {', '.join(map(printable, bad))}",
                      highlight=False)
    if left:
        console.print(f"[dim]{len(left)} unfinished save(s) or deletion(s), removed by the "
                      "next save here[/]", highlight=False)


@ckpt.command("verify")
@click.argument("directory", type=Folder())
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def verify_cmd(directory: str, as_json: bool) -> None:
    """Check every checksum of the checkpoint DIRECTORY, or of every checkpoint in it.

    Exit status 0 when all are intact, 2 when a problem was found.
    """
    from lcache.checkpoint import list_checkpoints, verify
    from lcache.checkpoint.dirs import require_dir
    from lcache.checkpoint.format import MANIFEST
    from lcache.errors import ConfigError

    require_dir(directory)  # a mistyped path is one line and exit status 2, not "DAMAGED"
    if os.path.lexists(os.path.join(directory, MANIFEST)):
        paths = [directory]
    else:
        good, bad = list_checkpoints(directory)
        paths = [c.path for c in good] + [os.path.join(directory, b) for b in bad]
        if not paths:  # a plain folder was "DAMAGED home: 0 arrays"
            raise ConfigError(f"{shown(directory)} is not a checkpoint (it has no {MANIFEST}; "
                              "an unfinished save has none either) and holds no checkpoint; "
                              "give a checkpoint or a folder of them")
    reports: list[dict[str, Any]] = []
    total = sum(_data_bytes(p) for p in paths)
    with Progress(*Progress.get_default_columns(), DownloadColumn(), TransferSpeedColumn(),
                  console=console, disable=as_json, transient=True) as bar:
        task = bar.add_task("verifying", total=total)
        for path in paths:
            reports.append(verify(path, progress=lambda n: bar.advance(task, n)).to_dict())
    ok = all(r["ok"] for r in reports)
    if as_json:
        click.echo(jsondoc.dumps({"ok": ok, "checkpoints": reports}, indent=2, sort_keys=True))
    else:
        for r in reports:
            mark = "[green]ok[/]" if r["ok"] else "[bold red]DAMAGED[/]"
            console.print(f"{mark} {printable(r['path'])}: {r['arrays']} arrays, "
                          f"{_size(r['data_bytes'])}", highlight=False)
            for problem in r["problems"]:
                console.print(f"  [red]problem:[/] {printable(problem)}", highlight=False)
    sys.exit(0 if ok else 2)


def _data_bytes(path: str) -> int:
    """Bytes the checkpoint's data files hold, per its manifest (0 when unreadable)."""
    from lcache.checkpoint import read_manifest
    from lcache.errors import LCacheError

    try:
        return sum(int(s["data_bytes"]) for s in read_manifest(path)["shards"])
    except (LCacheError, OSError, KeyError, TypeError, ValueError):
        return 0
