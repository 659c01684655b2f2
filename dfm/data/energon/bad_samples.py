"""What happens to a sample that cannot train: the run stops naming it, or it is skipped, counted
and named once in the log (``skip_bad_samples``).

One ``BadSampleLog`` per loader serves both the task encoder (our checks, ``BadSampleError``) and
energon's error handler (failures inside energon, e.g. a part that does not decode). Each worker
process gets its own copy, so counts are per worker.
"""

from __future__ import annotations

import logging
from pathlib import PurePosixPath
from typing import Any

from megatron.energon import SkipSample

from dfm.data.energon.cooker import BadSampleError, source_description

logger = logging.getLogger(__name__)


def describe_failed_sample(sample: Any, sources: Any) -> str:
    """'shard ..., key ...' of whatever energon hands its error handler (a sample, or raw tar parts)."""
    raw = getattr(sample, "data", None)
    if isinstance(raw, tuple) and raw and isinstance(raw[0], dict):
        sample = raw[0]  # energon's raw sample: the tar parts, before decoding
    if isinstance(sample, dict):
        key, sources = sample.get("__key__"), sources or sample.get("__sources__")
    else:
        key = getattr(sample, "__key__", None)
    if key is None and sources and sources[0].file_names:
        key = PurePosixPath(sources[0].file_names[0]).name.split(".")[0]
    return source_description(key, sources)


def describe_error(error: Exception) -> str:
    part = getattr(error, "k", None)  # webdataset's DecodingError names the part
    cause = error.__cause__
    if part is not None:
        return f"part '{part}' does not decode ({type(cause).__name__}: {cause})"
    return f"{type(error).__name__}: {error}"


class DataSettingError(ValueError):
    """A data setting that does not fit the data (not one sample's fault): stops the run, never skipped."""


class BadSampleLog:
    def __init__(self, skip: bool) -> None:
        self.skip = skip
        self.names: set[str] = set()  # 'shard ..., key ...' of each skipped sample

    @property
    def count(self) -> int:
        return len(self.names)

    def _skip(self, error: BadSampleError) -> None:
        if error.where not in self.names:
            self.names.add(error.where)
            logger.warning("bad sample skipped (%d in this worker): %s", self.count, error)

    def reject(self, error: BadSampleError) -> None:
        """From the task encoder: raise ``error``, or skip the sample (energon's SkipSample)."""
        if not self.skip:
            raise error
        self._skip(error)
        raise SkipSample() from error

    def handle(self, error: Exception, sample: Any, sources: Any = None) -> None:
        """energon's ``global_error_handler``: returning skips the sample, raising stops the run."""
        if isinstance(error, DataSettingError):
            raise error  # the setting's fault, not a sample's: never skipped, never blamed on a shard
        if not isinstance(error, BadSampleError):
            bad = BadSampleError(describe_failed_sample(sample, sources), describe_error(error))
            bad.__cause__ = error
            error = bad
        if not self.skip:
            raise error
        self._skip(error)
