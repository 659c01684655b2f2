"""energon's open shards without the tar headers they have read.

``tarfile.TarFile.next`` appends every header it reads to ``members`` (for ``getmembers`` and lookups
by name). energon's ``ITarReader`` keeps each shard open for the life of a loader and reads every
sample part through ``ITarFile.next``, so a loader keeps one ``TarInfo`` per part it has ever read:
memory that grows with the samples read, and objects that energon's ``GcDataset`` (a full collection
every 10 packs) walks again each time. On the digits-video run (3 parts a sample, 64 samples a pack)
that was 192 headers a pack, and a collection every 10 packs went from ~8 ms to ~400 ms by
iteration 1500 (2026-11-30). energon only ever hands the header it just read to ``extractfile``.
"""

from __future__ import annotations

import functools


def forgetting_read_headers(original):
    """Wraps ``ITarFile.next``: the header is returned, not kept in ``members``."""

    @functools.wraps(original)
    def next(self):
        tarinfo = original(self)
        self.members.clear()
        return tarinfo

    return next
