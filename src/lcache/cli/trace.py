"""``lcache trace -o TRACE -- CMD...`` and ``lcache report TRACE... -o report.html``."""

from __future__ import annotations

import contextlib
import errno
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import click

from lcache import jsondoc
from lcache.cli.checks import (
    STDOUT,
    check_outputs,
    check_replaceable,
    number_option,
    output_option,
)
from lcache.errors import ConfigError
from lcache.io import close_file
from lcache.trace.recorder import ENV, flush_interval


def _fail(message: str, code: int) -> None:
    # bad input (2) is said as every lcache command says it; a command that cannot run
    # (126, 127) as a shell, or `env` and `timeout`, say it
    click.echo(f"{'error' if code == 2 else 'lcache trace'}: {message}", err=True)
    sys.exit(code)


def run_traced(output: str, command: list[str], interval: float = 0.2,
               syscalls: bool = False, lib_events: bool = True) -> dict[str, Any]:
    """Run ``command`` with /proc sampling (and strace), writing the trace to ``output``.

    Returns a dict with ``exit_code`` (the command's, 128+N when killed by signal N, 127 when
    it cannot be found, 126 when it cannot be executed), ``seconds`` and counts.
    """
    from lcache.trace import strace as strace_mod
    from lcache.trace.sampler import ProcSampler
    from lcache.trace.writer import TraceWriter, process_metadata, wall_minus_mono_us

    exe = shutil.which(command[0])
    if exe is None:
        if "/" in command[0] and os.path.exists(command[0]):  # as a shell says it
            what = "is a directory" if os.path.isdir(command[0]) else "permission denied"
            return {"exit_code": 126, "error": f"{command[0]}: {what}"}
        return {"exit_code": 127, "error": f"{command[0]}: command not found"}
    argv = list(command)
    log_path = ""
    if syscalls:
        strace = shutil.which("strace")
        if strace is None:
            return {"exit_code": 2, "error": "--syscalls needs strace; install it "
                    "(Debian: apt-get install strace) or drop --syscalls"}
        fd, log_path = tempfile.mkstemp(prefix="lcache-strace-", suffix=".log")
        close_file(fd)
        argv = strace_mod.strace_command(log_path, argv, strace)
    try:
        check_outputs([("-o", output, "trace", False)])
        if lib_events:  # the command's lcache would refuse it: say so before it runs
            flush_interval()
    except ConfigError as exc:
        return {"exit_code": 2, "error": str(exc)}
    try:
        # a trace of this run only, not appended to an older one; a file that is not a
        # trace is refused, never replaced
        writer = TraceWriter(output, fresh=True)
        writer.write_lines(process_metadata(os.getpid(), "lcache trace " + " ".join(command)))
    except (OSError, ConfigError) as exc:  # before the command runs: nothing of it is lost
        if log_path:
            os.unlink(log_path)
        if isinstance(exc, ConfigError):
            return {"exit_code": 2, "error": str(exc)}
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW: a link is neither followed nor replaced
            return {"exit_code": 2, "error": f"cannot write the trace {output}: it is a "
                    "symbolic link; give -o a regular file or a new name"}
        return {"exit_code": 2, "error": f"cannot write the trace {output}: {exc.strerror}; "
                "give -o a path in a writable directory"}
    env = dict(os.environ)
    if lib_events:
        env[ENV] = writer.path  # Python commands that import lcache record their own events
    else:
        env.pop(ENV, None)
    start = time.perf_counter()
    child: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: Any) -> None:
        # Ctrl-C reaches the command through the terminal's process group; SIGTERM and SIGHUP
        # (a closed terminal, a dropped ssh) sent to lcache trace are passed on. Either way we
        # stay to write the trace and remove strace's log.
        if signum != signal.SIGINT and child:
            child[0].send_signal(signum)

    # A handler, not SIG_IGN: handlers are reset by exec, SIG_IGN would be inherited.
    old = {sig: signal.signal(sig, forward)
           for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        try:
            proc = subprocess.Popen(argv, env=env)
            child.append(proc)
        except OSError as exc:
            return {"exit_code": 127 if isinstance(exc, FileNotFoundError) else 126,
                    "error": f"{command[0]}: {exc.strerror}"}
        if log_path:
            strace_mod.wait_for_exec(proc.pid, argv[0])
        sampler = ProcSampler(proc.pid, writer, interval)
        sampler.start()
        # Wait for the exit without reaping, so the last sample still reads the zombie's
        # /proc/<pid>/io (the kernel drops it at reaping) and covers the final interval.
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        sampler.stop()
        code = proc.wait()
        if log_path:
            strace_mod.wait_for_tracer(log_path)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    seconds = time.perf_counter() - start
    syscall_events = 0
    if log_path:
        try:
            for lines in strace_mod.convert(log_path, wall_minus_mono_us()):
                writer.write_lines(lines)
                syscall_events += len(lines)
        finally:
            os.unlink(log_path)
    writer.close()
    return {"exit_code": code if code >= 0 else 128 - code, "seconds": round(seconds, 3),
            "samples": sampler.samples, "sampler_cpu_s": round(sampler.cpu_s, 6),
            "syscall_events": syscall_events,
            "trace": writer.path}


@click.command("trace", context_settings={"ignore_unknown_options": True,
                                          "allow_interspersed_args": False})
@output_option("-o", "--output", what="trace file", required=True,
               type=click.Path(dir_okay=False),
               help="Trace file to write (ending in .gz compresses it).")
@click.option("--interval", default="0.2", show_default=True,
              callback=number_option("--interval", float, 0.01, 3600),
              help="Seconds between samples of /proc/<pid>/io and /proc/diskstats "
                   "(0.01 to 3600).")
@click.option("--syscalls", is_flag=True,
              help="Also trace every file I/O system call with strace (slows the command).")
@click.option("--no-lib-events", "no_lib", is_flag=True,
              help="Do not set LCACHE_TRACE for the command (no in-library events).")
@click.option("--json", "as_json", is_flag=True,
              help="Print what was recorded as JSON on stderr when the command ends.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def trace_cmd(output: str, interval: float, syscalls: bool, no_lib: bool,
              as_json: bool, command: tuple[str, ...]) -> None:
    """Run COMMAND and record its I/O to a trace; exits with COMMAND's exit code.

    Always samples the I/O counters of the whole process tree and of the block devices; with
    --syscalls, records each file I/O system call; Python commands that use lcache record
    lcache's own events too (LCACHE_TRACE is set for them). Example:

        lcache trace -o run.trace -- python train.py --epochs 1
    """
    result = run_traced(output, list(command), interval, syscalls, not no_lib)
    if "error" in result:
        _fail(result["error"], result["exit_code"])
    if as_json:
        click.echo(jsondoc.dumps(result), err=True)
    else:
        click.echo(f"lcache trace: {result['trace']} ({result['seconds']:.1f} s, "
                   f"{result['samples']} samples, {result['syscall_events']} syscall events); "
                   f"view it with: lcache report {shlex.quote(output)} -o report.html",
                   err=True)
    sys.exit(result["exit_code"])


@click.command("report")
@click.argument("traces", nargs=-1, required=True, type=click.Path(dir_okay=False))
@output_option("-o", "--output", "html_path", what="report", default="report.html",
               show_default=True, type=click.Path(dir_okay=False),
               help="The self-contained HTML report.")
@output_option("--json", "json_path", what="summary file", type=click.Path(dir_okay=False),
               help="Also write the summary (per class) to this JSON file ('-' prints it).")
@output_option("--perfetto", what="Perfetto file", type=click.Path(dir_okay=False),
               help="Also write the events as one JSON array that Perfetto/chrome://tracing "
                    "open ('-' prints it).")
@output_option("--jsonl", what="JSON lines file", type=click.Path(dir_okay=False),
               help="Also write the events as Chrome trace events, one JSON object per line "
                    "(the recorder's binary blocks decoded; '-' prints them).")
def report_cmd(traces: tuple[str, ...], html_path: str, json_path: str | None,
               perfetto: str | None, jsonl: str | None) -> None:
    """Characterize the I/O in TRACES: an HTML report with plots, summary.json, a table.

    An output given as '-' is printed instead (only one, and then nothing else is)."""
    from lcache.report import (
        is_html_report,
        is_json_lines,
        is_json_summary,
        is_perfetto,
        json_lines_text,
        perfetto_text,
        print_summary,
        write_perfetto,
        write_report,
    )

    check_outputs([("-o", html_path, "report", False), ("--json", json_path, "summary", True),
                   ("--perfetto", perfetto, "trace", True), ("--jsonl", jsonl, "trace", True)],
                  traces)
    # each replaces only a file of its kind lcache wrote (./report.html is written unasked)
    check_replaceable([("-o", html_path, "report", is_html_report),
                       ("--json", json_path, "summary", is_json_summary),
                       ("--perfetto", perfetto, "Perfetto file", is_perfetto),
                       ("--jsonl", jsonl, "JSON lines file", is_json_lines)])
    # A bad trace raises TraceFormatError, which the CLI prints as one line (exit status 2).
    summary = write_report(list(traces), html_path,
                           None if json_path in (None, STDOUT) else json_path)
    printed = None
    if perfetto == STDOUT:
        printed = perfetto_text(list(traces))
    elif perfetto:
        write_perfetto(list(traces), perfetto)
    if jsonl:
        from lcache.io.publish import atomic_write

        text = json_lines_text(list(traces))
        if jsonl == STDOUT:
            printed = text
        else:
            atomic_write(jsonl, text.encode())
    if json_path == STDOUT:
        printed = jsondoc.dumps(summary, indent=2) + "\n"
    if printed is not None:
        click.echo(printed, nl=False)
    else:
        print_summary(summary)
        click.echo(f"report: {html_path}" + (f", summary: {json_path}" if json_path else ""))
