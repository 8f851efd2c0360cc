"""Asynchronous, crash-safe checkpoints on the local SSD (see docs/checkpoint.md).

    from lcache import checkpoint

    handle = checkpoint.async_save({"model": model.state_dict(), "step": step},
                                   f"ckpts/step-{step:06d}", keep_last=3)
    ...                                  # training continues while it is written
    handle.wait()                        # or just save again: the next save waits for it
    state = checkpoint.load(checkpoint.latest("ckpts"), like=reference_state)

torch is optional: states of numpy arrays and plain values need only numpy.
"""

from lcache.checkpoint.api import (
    Checkpointer,
    CheckpointHandle,
    CkptState,
    async_save,
    default_checkpointer,
    save,
)
from lcache.checkpoint.dirs import (
    CheckpointInfo,
    apply_retention,
    clean_leftovers,
    latest,
    leftovers,
    list_checkpoints,
    remove_checkpoint,
)
from lcache.checkpoint.errors import (
    CheckpointExistsError,
    CheckpointFailedError,
    CheckpointNotFoundError,
    StateMismatchError,
    UnsupportedValueError,
)
from lcache.checkpoint.restore import VerifyReport, load, read_manifest, verify
from lcache.checkpoint.upload import upload_checkpoint

__all__ = [
    "CheckpointExistsError",
    "CheckpointFailedError",
    "CheckpointHandle",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "Checkpointer",
    "CkptState",
    "StateMismatchError",
    "UnsupportedValueError",
    "VerifyReport",
    "apply_retention",
    "async_save",
    "clean_leftovers",
    "default_checkpointer",
    "latest",
    "leftovers",
    "list_checkpoints",
    "load",
    "read_manifest",
    "remove_checkpoint",
    "save",
    "upload_checkpoint",
    "verify",
]
