"""Emit a DLIO workload that reproduces the fitted data-read and checkpoint pattern.

The workload is DLIO's YAML (docs/bench.md), so it runs with ``lcache bench run`` and with
DLIO itself; it is checked by the bench's own parser before it is handed out. Every choice
the trace could not make is written in ``notes``.
"""

from __future__ import annotations

from typing import Any

import yaml

from lcache.bench import parse_workload
from lcache.checks import shown


def workload(fitted: dict[str, Any], name: str = "advised") -> tuple[dict[str, Any], list[str]]:
    """(the DLIO workload mapping, notes on what was assumed). Raises ConfigError if the
    fitted figures make no valid workload (a bug: they are checked here)."""
    notes: list[str] = []
    ds, ck = fitted["dataset"], fitted["checkpoint"]
    doc: dict[str, Any] = {"model": {"name": name}, "framework": "pytorch",
                           "workflow": {"generate_data": True, "train": ds is not None,
                                        "checkpoint": ck is not None}}
    if ds is not None:
        doc["dataset"], doc["reader"], doc["train"] = _data(fitted, notes)
    if ck is not None:
        doc["model"]["model_size_bytes"] = max(1, ck["bytes_p50"])
        doc["checkpoint"] = _checkpoint(fitted, ds is not None, notes)
    if ds is None and ck is None:
        notes.append("neither data reads nor checkpoint writes: nothing to emit")
        doc["workflow"] = {"generate_data": False, "train": False, "checkpoint": False}
        return doc, notes
    parse_workload(_copy(doc), "<lcache advise>")  # what we hand out must run
    return doc, notes


NPY_HEADER = 128  # np.save's header (format 1.0) of the arrays DLIO and lcache bench write


def _copy(doc: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(yaml.safe_dump(doc))  # type: ignore[no-any-return]


def _data(fitted: dict[str, Any], notes: list[str]) -> tuple[dict[str, Any], ...]:
    steps, ds = fitted["steps"], fitted["dataset"]
    data = fitted["groups"].get("data", {})
    record = round(ds["record_bytes_mean"])
    dataset: dict[str, Any] = {"data_folder": "./data/"}
    if ds["record_bytes_stdev"] > 0:
        dataset["record_length_bytes_stdev"] = round(ds["record_bytes_stdev"])
    if ds["whole_files"]:  # one sample per file, read whole: npy files, as DLIO reads them
        # the files read whole held np.save's header too: the sample is the rest (each
        # round trip grew the samples by 128 bytes)
        record -= NPY_HEADER if record > NPY_HEADER else 0
        dataset.update(format="npy", num_files_train=ds["samples"], num_samples_per_file=1)
        notes.append("npy files hold a 128-byte header before the sample, read with it")
    else:  # samples at offsets in shared files: an indexed binary read by exact ranges
        dataset.update(format="indexed_binary", num_files_train=ds["files"],
                       num_samples_per_file=ds["samples_per_file"])
    dataset["record_length_bytes"] = max(1, record)
    batch = steps["batch_samples"]
    compute = steps["compute_s"]
    ranks = steps.get("ranks", 1)
    # a rank's reader threads: the trace's most at once were all ranks'
    threads = 0 if steps["reads_in_training_thread"] else max(1, -(-data.get("threads", 1)
                                                                     // ranks))
    if ranks > 1:
        notes.append(f"the trace holds {ranks} ranks stepping together: batch_size, "
                     "read_threads and the steps are one rank's; run the workload with "
                     f"{ranks} ranks (torchrun --nproc_per_node {ranks} -m lcache bench run) to "
                     "load the storage as the traced job did")
    if not batch and steps["source"]:  # steps, but too few sample reads for a batch
        batch = 1
        notes.append(f"batch_size 1: {steps['why']}; computation_time is the fitted compute "
                     "per step")
    elif not batch:
        batch = 1
        mbps = data.get("MBps_mean") or 0.0
        compute = ds["record_bytes_mean"] / (mbps * 1e6) if mbps else 0.0
        notes.append("no steps in the trace: batch_size 1, and computation_time the time the "
                     f"trace took per sample ({compute:.6f} s at {mbps:,.1f} MB/s), so the "
                     "workload asks the measured data bandwidth; record step markers to fit "
                     "the real batch and compute")
    elif steps["source"] == "rhythm" and not steps["reads_in_training_thread"]:
        notes.append("reads ran ahead of compute: computation_time is the step period (an "
                     "upper bound on compute when the readers never waited)")
    reader = {"data_loader": "pytorch", "batch_size": batch, "read_threads": threads,
              "prefetch_size": max(threads, steps.get("prefetch_batches") or 0) or 2}
    epochs = max(1, round(ds["epochs_seen"]))
    traced = round(ds.get("epochs_read", ds["epochs_seen"]))
    if traced > epochs:
        notes.append(f"train.epochs {epochs} counts the source reads only: cache hits were "
                     f"left out of the epochs, and the traced run read {traced} epochs of "
                     "samples (source reads and cache hits)")
    train = {"epochs": epochs, "computation_time": round(compute or 0.0, 6)}
    return dataset, reader, train


def _checkpoint(fitted: dict[str, Any], training: bool, notes: list[str]) -> dict[str, Any]:
    ck = fitted["checkpoint"]
    out: dict[str, Any] = {"checkpoint_folder": "./checkpoints/", "fsync": ck["fsync"]}
    if not training:
        out["num_checkpoints_write"] = ck["saves"]
        out["num_checkpoints_read"] = min(ck["loads"], ck["saves"])
        if ck["interval_s"]:
            out["time_between_checkpoints"] = round(
                max(0.0, ck["interval_s"] - ck["duration_s_p50"]), 6)
    elif ck["interval_steps"]:
        out["steps_between_checkpoints"] = ck["interval_steps"]
    else:
        notes.append("checkpoint interval in steps unknown (no steps): one per epoch")
    return out


#: the YAML's first line starts so (a comment; a loader skips it)
YAML_HEAD = "# DLIO workload fitted by `lcache advise`"


def is_workload_yaml(head: bytes) -> bool:
    """Whether ``head`` (a file's first 4 KiB) starts a workload :func:`to_yaml` wrote: what
    ``lcache advise --emit`` may replace."""
    return head.startswith(f"{YAML_HEAD} from ".encode())


def to_yaml(doc: dict[str, Any], notes: list[str], source: str) -> str:
    """The workload as a DLIO YAML file, its notes as comments (line breaks in them
    escaped: a trace named "x\noutput: {folder: y}" made that a key of the workload)."""
    head = [f"{YAML_HEAD} from {shown(source)}",
            "# run: lcache bench run THIS.yaml --data-dir DIR (or DLIO: workload=THIS)"]
    head += [f"# note: {shown(n)}" for n in notes]
    return "\n".join(head) + "\n" + yaml.safe_dump(doc, sort_keys=False)

