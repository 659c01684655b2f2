"""``verify``'s reading of a checkpoint's pickles: ``.metadata`` and every per-rank object, as data only."""

from __future__ import annotations

import io
from pathlib import Path

from dfm.safe_files import confined_path
from dfm.safe_unpickle import (
    EXTRA_STATE,
    UnsafePickleError,
    extra_state_as_data,
    load_checkpoint_metadata,
    load_rank_object,
    load_weights_only,
)

COMMON = "common.pt"  # megatron's common state (iteration, config, schedule): torch.save bytes


def pickled_faults(directory: Path) -> list[str]:
    """Every pickle of a distributed checkpoint (``common.pt``, ``.metadata``, per-rank objects) read as data;
    -> refusals.

    A manifest proves no authenticity (whoever crafts a file writes the manifest), so ``verify`` reads these too.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    faults = []
    if (directory / COMMON).is_file():
        try:
            load_weights_only(directory / COMMON, map_location="cpu")
        except (UnsafePickleError, OSError, RuntimeError) as error:
            faults.append(str(error))
    try:
        with open(directory / ".metadata", "rb") as file:
            metadata = load_checkpoint_metadata(file)
    except FileNotFoundError:
        return faults  # a missing .metadata is reported by the manifest check
    except UnsafePickleError as error:
        return [*faults, str(error)]
    for index, info in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        file = confined_path(directory, info.relative_path)
        if file is None:
            faults.append(f"{directory / '.metadata'}: names {info.relative_path!r}, outside the checkpoint folder")
            continue
        try:
            with open(file, "rb") as handle:
                handle.seek(info.offset)
                loaded = load_rank_object(
                    io.BytesIO(handle.read(info.length)), f"{file}: per-rank object '{index.fqn}'"
                )
            if index.fqn.partition("/")[0].endswith(EXTRA_STATE):
                extra_state_as_data(loaded, f"{file}: extra state '{index.fqn}'")
        except (UnsafePickleError, OSError) as error:
            faults.append(str(error))
    return faults
