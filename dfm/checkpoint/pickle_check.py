"""``verify``'s reading of a checkpoint's pickles: ``.metadata`` and every per-rank object, as data only."""

from __future__ import annotations

import io
from pathlib import Path

from dfm.safe_unpickle import UnsafePickleError, load_checkpoint_metadata, load_rank_object


def pickled_faults(directory: Path) -> list[str]:
    """Every pickle of a distributed checkpoint (``.metadata``, per-rank objects) read as data; -> refusals.

    A manifest proves no authenticity (whoever crafts a file writes the manifest), so ``verify`` reads these too.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    try:
        with open(directory / ".metadata", "rb") as file:
            metadata = load_checkpoint_metadata(file)
    except FileNotFoundError:
        return []  # reported as missing by the manifest check
    except UnsafePickleError as error:
        return [str(error)]
    faults = []
    for index, info in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        file = directory / info.relative_path
        try:
            with open(file, "rb") as handle:
                handle.seek(info.offset)
                load_rank_object(io.BytesIO(handle.read(info.length)), f"{file}: per-rank object '{index.fqn}'")
        except (UnsafePickleError, OSError) as error:
            faults.append(str(error))
    return faults
