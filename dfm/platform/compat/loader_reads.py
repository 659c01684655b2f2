"""energon's reads of a shard: no tar header kept after reading, no metrics built for no instrument.

``tarfile.TarFile.next`` appends every header it reads to ``members`` (for ``getmembers`` and lookups
by name). energon's ``ITarReader`` keeps each shard open for the life of a loader and reads every
sample part through ``ITarFile.next``, so a loader kept one ``TarInfo`` per part it had ever read:
memory that grows with the samples read, and objects that energon's ``GcDataset`` (a full collection
every 10 packs) walks again each time. On the digits-video run (3 parts a sample, 64 samples a pack)
that was 192 headers a pack, and a collection every 10 packs went from ~5 ms to hundreds of ms by
iteration 1500 (2026-11-30). energon only ever hands the header it just read to ``extractfile``.

Each read, seek and tell of a shard goes through multistorageclient, which times it and builds the
metric attributes for its telemetry instruments even when none is configured (then nothing is recorded):
~2.6 % of the digits-video run's CPU (py-spy, 2026-11-30).
"""

from __future__ import annotations

import functools

from dfm.platform.compat.patch import Patch


def forgetting_read_headers(original):
    """Wraps ``ITarFile.next``: the header is returned, not kept in ``members``."""

    @functools.wraps(original)
    def next(self):
        tarinfo = original(self)
        self.members.clear()
        return tarinfo

    return next


def without_instruments_just_call(original):
    """Wraps ``BaseStorageProvider._emit_metrics``: with no gauge or counter configured (no telemetry),
    the operation runs without the timing and attribute building that would record nothing."""

    @functools.wraps(original)
    def _emit_metrics(self, operation, f):
        if not self._metric_init_event.is_set():
            self._init_metrics()
        if not (self._metric_gauges or self._metric_counters):
            return f()
        return original(self, operation, f)

    return _emit_metrics


# Not about the device: energon's loader, applied by ``install_loader_patches()`` when a loader is built
# (importing energon costs ~0.5 s that a --mock run does not pay). Written for the versions in
# patch.WRITTEN_FOR (megatron-energon 7.4.1, multi-storage-client 1.3.1), which a mismatch names.
LOADER_PATCHES = (
    Patch(
        name="energon-tar-headers-forgotten",
        module="megatron.energon.flavors.webdataset.itar",
        attribute="ITarFile.next",
        why="an open shard keeps every tar header it reads (tarfile's members list): a loader's memory "
        "and its garbage collections grow with every sample read",
        relies_on=("if self.in_init:", "return super().next()"),
        replace=forgetting_read_headers,
        cpu_only=False,
    ),
    Patch(
        name="storage-metrics-without-instruments",
        module="multistorageclient.providers.base",
        attribute="BaseStorageProvider._emit_metrics",
        why="every shard read, seek and tell builds metric attributes even when no telemetry instrument "
        "is configured to record them",
        relies_on=(
            "metric_latency = self._metric_gauges.get(Telemetry.GaugeName.LATENCY)",
            "metric_data_size_sum = self._metric_counters.get(Telemetry.CounterName.DATA_SIZE_SUM)",
            "attributes = self._build_base_attributes(operation)",
        ),
        replace=without_instruments_just_call,
        site="BaseStorageProvider._record_metrics",
        cpu_only=False,
    ),
)
