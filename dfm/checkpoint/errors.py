"""What a checkpoint save or load raises for problems on disk (the message names the directory)."""


class CheckpointError(RuntimeError):
    """A checkpoint is damaged, incomplete, or does not fit the run; the message says which and why."""


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed (disk full, I/O error, too little room); ``latest`` did not move."""
