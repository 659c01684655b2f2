"""Train / validation loaders over energon datasets (a prepared folder or a metadataset yaml).

The WorkerConfig's rank and world size are the DATA-PARALLEL rank and size, passed in by the
trainer: TP/CP/PP ranks of one model replica build identical loaders and see identical packs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from megatron.energon import (
    WorkerConfig,
    get_loader,
    get_savable_loader,
    get_train_dataset,
    get_val_dataset,
)

from dfm.data.energon import loader_state
from dfm.data.energon.bad_samples import BadSampleLog
from dfm.data.energon.dataset_checks import check_energon_dataset
from dfm.data.energon.task_encoder import TOO_LONG_MAX_FRACTION, DiffusionTaskEncoder, PackingSettings
from dfm.data.packed_batch import PackedBatch
from dfm.safe_unpickle import array_globals, restricted_loads

STATE_FORMAT = "dfm-energon-loader/v2"  # energon's state as JSON text (loader_state.py)
PICKLED_STATE_FORMAT = "dfm-energon-loader/v1"  # older checkpoints: pickled bytes, read as data only


@dataclass
class EnergonDataSettings:
    path: str  # energon dataset folder or metadataset .yaml
    packing: PackingSettings
    packing_buffer_size: int = 256  # samples per first-fit-decreasing round
    num_workers: int = 2
    shuffle_buffer_size: int = 100
    max_samples_per_sequence: int | None = 100  # shard-local runs before jumping to another shard
    seed: int = 1234  # energon's seed_offset: shard order and shuffling
    val_path: str | None = None  # defaults to ``path`` (its "val" split)
    val_limit: int | None = None  # max validation packs per pass
    skip_bad_samples: bool = False  # False: a broken sample stops the run with its shard and key
    allow_pickle: bool = False  # True: '.pickle' parts through full pickle (trusted data only)
    allow_code: bool = False  # True: the metadata may name Python for energon to run (trusted data only)
    prefetch_factor: int = 2
    cooked_cache_mib: int = 0  # decoded samples kept per worker (cooked_cache.py); 0: none
    extra_worker_kwargs: dict[str, Any] = field(default_factory=dict)


def build_worker_config(
    settings: EnergonDataSettings, dp_rank: int, dp_size: int, bad_samples: BadSampleLog
) -> WorkerConfig:
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
    return WorkerConfig(
        rank=dp_rank,
        world_size=dp_size,
        num_workers=settings.num_workers,
        seed_offset=settings.seed,
        global_error_handler=bad_samples.handle,
        **settings.extra_worker_kwargs,
    )


def build_train_dataset(settings: EnergonDataSettings, dp_rank: int, dp_size: int):
    check_energon_dataset(settings.path, settings.allow_code)
    bad_samples = BadSampleLog(settings.skip_bad_samples)
    return get_train_dataset(
        settings.path,
        split_part="train",
        worker_config=build_worker_config(settings, dp_rank, dp_size, bad_samples),
        batch_size=1,
        packing_buffer_size=settings.packing_buffer_size,
        shuffle_buffer_size=settings.shuffle_buffer_size,
        max_samples_per_sequence=settings.max_samples_per_sequence,
        task_encoder=task_encoder(settings, bad_samples),
    )


def task_encoder(settings: EnergonDataSettings, bad_samples: BadSampleLog) -> DiffusionTaskEncoder:
    return DiffusionTaskEncoder(
        settings.packing,
        bad_samples,
        settings.allow_pickle,
        max_too_long_fraction=TOO_LONG_MAX_FRACTION,
        cooked_cache_bytes=settings.cooked_cache_mib << 20,
    )


class EnergonTrainLoader:
    """Infinite iterator of PackedBatches for one DP rank, with checkpointable state."""

    def __init__(self, settings: EnergonDataSettings, dp_rank: int, dp_size: int) -> None:
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.loader = get_savable_loader(
            build_train_dataset(settings, dp_rank, dp_size), prefetch_factor=settings.prefetch_factor
        )
        self._iterator: Iterator[PackedBatch] | None = None
        self._bad_samples_by_worker: dict[int, int] = {}

    def __iter__(self) -> Iterator[PackedBatch]:
        return self

    def __next__(self) -> PackedBatch:
        if self._iterator is None:
            self._iterator = iter(self.loader)
        batch = next(self._iterator)
        worker, count = getattr(batch, "bad_samples", (0, 0))
        self._bad_samples_by_worker[worker] = count
        return batch

    @property
    def skipped_bad_samples(self) -> int:
        """Bad samples this DP rank's workers skipped since the loader started."""
        return sum(self._bad_samples_by_worker.values())

    def state_dict(self) -> dict[str, Any]:
        """Plain types only (the energon state as JSON text), so a checkpoint holds it as data."""
        return {
            "format": STATE_FORMAT,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "energon_state": loader_state.dumps(self.loader.save_state_rank()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore before the first ``next``: iteration then continues with exactly the next pack."""
        if state.get("format") not in (STATE_FORMAT, PICKLED_STATE_FORMAT):
            raise ValueError(f"loader state has format {state.get('format')!r}, expected {STATE_FORMAT!r}")
        for key, value in (("dp_rank", self.dp_rank), ("dp_size", self.dp_size)):
            if state[key] != value:
                raise ValueError(f"loader state was saved with {key}={state[key]}, this loader has {key}={value}")
        if self._iterator is not None:
            raise RuntimeError("load_state_dict must be called before the loader is iterated")
        self.loader.restore_state_rank(energon_state(state))


def energon_state(state: dict[str, Any]) -> Any:
    """energon's state from a saved loader state: JSON text, or (v1) a pickle admitting energon's state types only."""
    if state["format"] == STATE_FORMAT:
        return loader_state.loads(state["energon_state"])
    from megatron.energon.state import FlexState

    allowed = {(cls.__module__, cls.__qualname__): cls for cls in (*loader_state.state_classes().values(), FlexState)}
    return restricted_loads(state["energon_state"], {**array_globals(), **allowed}, "the saved loader state (v1)")


def build_train_loader(settings: EnergonDataSettings, dp_rank: int, dp_size: int) -> EnergonTrainLoader:
    return EnergonTrainLoader(settings, dp_rank, dp_size)


def build_val_loader(settings: EnergonDataSettings, dp_rank: int, dp_size: int):
    """One pass over the "val" split (of ``val_path`` or ``path``), packed like training."""
    check_energon_dataset(settings.val_path or settings.path, settings.allow_code)
    bad_samples = BadSampleLog(settings.skip_bad_samples)
    dataset = get_val_dataset(
        settings.val_path or settings.path,
        split_part="val",
        worker_config=build_worker_config(settings, dp_rank, dp_size, bad_samples),
        batch_size=1,
        packing_buffer_size=settings.packing_buffer_size,
        limit=settings.val_limit,
        task_encoder=task_encoder(settings, bad_samples),
    )
    return get_loader(dataset, prefetch_factor=settings.prefetch_factor)


def write_blend_metadataset(
    yaml_path: str | Path, datasets: Sequence[tuple[str | Path, float]], val_datasets: Sequence[str | Path] = ()
) -> Path:
    """Write an energon MetadatasetV2 yaml blending ``(dataset folder, weight)`` pairs for training."""
    if not datasets:
        raise ValueError(f"{yaml_path}: a blend needs at least one dataset")
    yaml_path = Path(yaml_path)
    splits: dict[str, Any] = {
        "train": {"blend": [{"weight": float(w), "path": str(Path(p).resolve())} for p, w in datasets]}
    }
    if val_datasets:
        splits["val"] = {"blend": [{"path": str(Path(p).resolve()), "subflavors": {}} for p in val_datasets]}
    yaml_path.write_text(
        yaml.safe_dump({"__module__": "megatron.energon", "__class__": "MetadatasetV2", "splits": splits})
    )
    return yaml_path
