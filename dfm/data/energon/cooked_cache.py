"""Decoded, checked samples kept in a loader worker's memory, for datasets trained for many epochs.

A small dataset (a fine-tune on a few thousand samples, the digits demos: 500 clips read 190 times
in 1500 iterations) pays decoding and checking its parts again every epoch: in the digits-video loader
that was ~55 % of a pack's CPU. With ``dataset.cooked_cache_mib`` > 0, each worker keeps the first
samples it cooks, up to that many MiB of tensors, and hands a hit back with the reading's own keys.
energon still reads every sample from its shard (order, shuffling and the loader state are energon's).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from dfm.data.energon.cooker import CookedDiffusionSample, describe_source


def tensor_bytes(sample: CookedDiffusionSample) -> int:
    """The bytes of every tensor field of ``sample``."""
    values = (getattr(sample, field.name) for field in dataclasses.fields(sample))
    return sum(value.nbytes for value in values if isinstance(value, torch.Tensor))


class CookedSampleCache:
    """{shard and key: cooked sample}, filled until ``limit_bytes`` (0: off); never evicts. Hits share
    the tensors (nothing after cooking writes into them) in a fresh sample object."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.held_bytes = 0
        self.samples: dict[str, CookedDiffusionSample] = {}

    def get(self, crude: dict[str, Any]) -> CookedDiffusionSample | None:
        """The cooked sample of ``crude`` (same shard and key) with ``crude``'s restore key, or None."""
        if not self.limit_bytes:
            return None
        hit = self.samples.get(describe_source(crude))
        if hit is None:
            return None
        return dataclasses.replace(hit, __restore_key__=crude.get("__restore_key__"))

    def put(self, crude: dict[str, Any], cooked: CookedDiffusionSample) -> None:
        if not self.limit_bytes:  # off (the default): nothing to size on the loader's hot path
            return
        size = tensor_bytes(cooked)
        if self.held_bytes + size <= self.limit_bytes:
            # A copy of the fields: energon rewrites the restore key of the sample it is handed.
            self.samples[describe_source(crude)] = dataclasses.replace(cooked)
            self.held_bytes += size
