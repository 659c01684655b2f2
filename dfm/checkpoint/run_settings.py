"""Resume compares the run settings that change what training means with the checkpoint's.

- Data settings (batch sizes, packing length, mock vs energon data, the dataset path or blend, energon's read order, the
  mock data's shapes): a change is refused, naming old and new, unless
  ``checkpoint.allow_setting_changes=true``; then the change is logged and the data position starts over (the saved one belongs to other data).
- Learning-rate and schedule settings: a change is logged and takes effect from the resumed
  iteration on (megatron would otherwise keep the checkpoint's values, silently).
- The diffusion pipeline (``model.pipeline``, EDM or flow): refused like a data setting; with
  ``checkpoint.allow_setting_changes=true`` logged and applied from the resumed iteration on.
- The precision (``mixed_precision.precision``): always refused, naming old and new (the optimizer state
  is laid out for it); ``checkpoint.pretrained`` starts a run at another precision from the weights.
- Distillation (``distill.*``, docs/distillation.md): switching ``distill.enabled`` either way is always
  refused; what the student is trained to become is refused like the pipeline; how it gets there is logged
  and applied like the lr (the key lists below say which is which and why).
- An energon ``dataset.path`` is compared by the dataset's identity recorded at save (its energon index
  uuid, or a metadataset file's checksum), so another spelling of the same folder (a trailing slash, a
  link, a relative path) is no change and another dataset under the same string is one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from dfm.checkpoint.errors import CheckpointError
from dfm.config.container import ConfigContainer
from dfm.config.distill import shifted_times
from dfm.config.loader import config_to_dict

logger = logging.getLogger("dfm.checkpoint")

# Common-state key of a checkpoint: "mock" or "energon", the data its position belongs to.
DATA_KIND = "data_kind"
DATA_KEYS = ("train.micro_batch_size", "train.global_batch_size", "dataset.seq_length")
KIND_KEYS = {  # what defines the samples of each kind of data
    "energon": ("dataset.path",),
    "mock": (
        "dataset.mock_image_fraction",
        "dataset.mock_image_sizes",
        "dataset.mock_video_sizes",
        "dataset.mock_text_len_range",
        "dataset.mock_samples_per_pack",
    ),
}
# energon's read order; checkpoints from before these were settings read with both at 100.
READ_ORDER_KEYS = {"dataset.shuffle_buffer_size": 100, "dataset.max_samples_per_sequence": 100}
PIPELINE_KEYS = ("model.pipeline",)
PRECISION_KEYS = ("mixed_precision.precision",)
# A distillation's checkpoint holds a critic and its optimizer beside the student, a plain one holds none: a
# switch either way cannot resume (checkpoint.pretrained starts a new run from either's model), so it is
# always refused. Checkpoints from before the distill section are plain.
DISTILL_ENABLED = "distill.enabled"
# What the student is trained to become: a map from noise at exactly these times (a student trained at
# [1, 0.75, 0.5, 0.25] samples with them), the teacher's guided distribution it matches, the paired loss.
# A change is another distillation: refused like the pipeline; with checkpoint.allow_setting_changes=true
# (e.g. fewer student steps after the first phase) logged and applied from the resumed iteration on.
DISTILL_TARGET_KEYS = (
    "distill.student_timesteps",
    "distill.guidance_scale",
    "distill.regression_weight",
    "distill.regression_teacher_steps",
    "distill.gan_student_weight",
    "distill.gan_critic_weight",
)
# How it gets there: the re-noising law of both losses and the two-time-scale rule change the path, not the
# distribution the student converges to, and the critic (trained every iteration, at that law) follows a
# new law within its updates: logged and applied, like the lr.
DISTILL_SCHEDULE_KEYS = ("distill.min_t", "distill.max_t", "distill.critic_steps")
# Common-state key: the energon dataset's identity at save (dataset_identity()).
DATASET_ID = "dataset_identity"
SCHEDULE_KEYS = (
    "optimizer.lr",
    "optimizer.min_lr",
    "optimizer.weight_decay",
    "scheduler.lr_warmup_iters",
    "scheduler.lr_decay_style",
    "scheduler.lr_decay_iters",
)


@dataclasses.dataclass
class ResumeSettings:
    """What resuming restores: the data position (or not), the checkpoint's schedule (or this run's, with
    its (lr, min_lr))."""

    data_position: bool = True
    new_lr: tuple[float, float] | None = None


def restore_schedule(scheduler, optimizer, saved: dict, settings: ResumeSettings) -> None:
    """The checkpoint's step count; its lr values, or this run's where they changed.

    megatron keeps the checkpoint's values unless told to override, and its optimizer's parameter
    groups carry their own ``max_lr`` / ``min_lr`` (restored with the optimizer state).
    """
    scheduler.override_opt_param_scheduler = settings.new_lr is not None
    if settings.new_lr is not None:
        for group in optimizer.param_groups:
            group["max_lr"], group["min_lr"] = settings.new_lr
    scheduler.load_state_dict(saved)


def data_kind(loader) -> str:
    """``"mock"`` or ``"energon"``: the kind of the training loader (or the loader a wrapper holds)."""
    from dfm.data.mock import MockPackedLoader

    return "mock" if isinstance(getattr(loader, "loader", loader), MockPackedLoader) else "energon"


def compare_run_settings(common: dict, directory: Path, cfg: ConfigContainer | None, kind: str) -> ResumeSettings:
    """Refuse (or, with ``checkpoint.allow_setting_changes``, log) data-setting changes; log schedule changes.

    ``cfg`` None (a caller without a run config): nothing is compared.
    """
    if cfg is None:
        return ResumeSettings()
    saved = common.get("config")
    if not saved:
        logger.warning("checkpoint %s holds no run config: its settings are not compared", directory)
        return ResumeSettings()
    now = config_to_dict(cfg)
    data = differences(saved, now, DATA_KEYS)
    saved_kind = common.get(DATA_KIND, kind)  # checkpoints before dfm recorded it: taken as unchanged
    if saved_kind != kind:
        data.append(f"data: checkpoint {saved_kind}, this run {kind}")
    elif kind == "energon":
        data += dataset_change(common, saved, now) + read_order_changes(saved, now)
    else:
        data += differences(saved, now, KIND_KEYS[kind])
    schedule = differences(saved, now, SCHEDULE_KEYS, resolved_decay_iters)
    precision = differences(saved, now, PRECISION_KEYS)
    if precision:
        raise CheckpointError(
            f"checkpoint {directory} was trained at another precision: {'; '.join(precision)}. A checkpoint resumes "
            f"at the precision it was saved with (its optimizer state is laid out for it); set it back, or start a "
            f"new run from its weights with checkpoint.pretrained={directory}"
        )
    pipeline = differences(saved, now, PIPELINE_KEYS)
    if pipeline and not cfg.checkpoint.allow_setting_changes:
        raise CheckpointError(
            f"checkpoint {directory} was trained with another diffusion pipeline: {'; '.join(pipeline)}. Set it "
            "back to resume, or set checkpoint.allow_setting_changes=true to continue training with the new one"
        )
    refuse_distill_switch(saved, now, directory)
    refuse_classifier_switch(saved, now, directory)
    distill_target, distill_schedule = distill_differences(saved, now, DISTILL_TARGET_KEYS, DISTILL_SCHEDULE_KEYS)
    if distill_target and not cfg.checkpoint.allow_setting_changes:
        raise CheckpointError(
            f"checkpoint {directory} distils towards another target: {'; '.join(distill_target)}. Set them back "
            "to resume, or set checkpoint.allow_setting_changes=true to continue distilling with the new ones"
        )
    if data and not cfg.checkpoint.allow_setting_changes:
        raise CheckpointError(
            f"checkpoint {directory} was trained with other data settings: {'; '.join(data)}. Set them back "
            "to resume exactly, or set checkpoint.allow_setting_changes=true to continue with the new ones "
            "(the data position then starts over)"
        )
    for change in data:
        logger.warning("resuming %s with a changed setting, %s: the data position starts over", directory, change)
    for change in schedule + pipeline + distill_target + distill_schedule:
        logger.warning("resuming %s with a changed setting, %s: the new value applies from here on", directory, change)
    new_lr = (cfg.optimizer.lr, cfg.optimizer.min_lr) if schedule else None
    return ResumeSettings(data_position=not data, new_lr=new_lr)


def distilling(config: dict) -> bool:
    """Whether ``config`` (a saved or current run config) is a distillation's; no distill section: no."""
    return bool(value_at(config, DISTILL_ENABLED))


def refuse_distill_switch(saved: dict, now: dict, directory: Path) -> None:
    """Raise when one of the checkpoint and this run distils and the other does not."""
    if distilling(saved) == distilling(now):
        return
    change = f"{DISTILL_ENABLED}: checkpoint {distilling(saved)}, this run {distilling(now)}"
    held = "holds a critic beside its student" if distilling(saved) else "holds no critic"
    raise CheckpointError(
        f"checkpoint {directory} {held} ({change}): a run resumes only a checkpoint of its own kind. Set "
        f"{DISTILL_ENABLED} back to resume, or start a new run from its model with checkpoint.pretrained={directory}"
    )


def has_classifier(config: dict) -> bool:
    """Whether a distillation's critic carries the GAN classifier (``distill.gan_critic_weight`` > 0)."""
    return distilling(config) and bool(value_at(config, "distill.gan_critic_weight"))


def refuse_classifier_switch(saved: dict, now: dict, directory: Path) -> None:
    """Raise when the GAN loss is on in one of the checkpoint and this run and off in the other: the critic's
    classifier is there or it is not, whatever ``checkpoint.allow_setting_changes`` says."""
    if not distilling(now) or has_classifier(saved) == has_classifier(now):
        return
    change = differences(saved, now, ("distill.gan_critic_weight",), resolved_distill)[0]
    held = "holds a GAN classifier on its critic" if has_classifier(saved) else "holds no GAN classifier"
    raise CheckpointError(
        f"checkpoint {directory} {held} ({change}): the GAN loss stays on or off within a run. Set the weight "
        f"back to resume, or start a new distillation from the teacher"
    )


def distill_differences(saved: dict, now: dict, *groups: tuple[str, ...]) -> tuple[list[str], ...]:
    """``differences`` of each group of ``distill.*`` keys; none when this run does not distil (its
    distill settings are unused)."""
    return tuple(differences(saved, now, keys, resolved_distill) if distilling(now) else [] for keys in groups)


def resolved_distill(config: dict, key: str, value: Any) -> Any:
    """The teacher's step count for the regression targets matters only where the regression is on
    (checkpoints from before the key, which had it off, lack it); a GAN weight a checkpoint lacks was 0; the
    student's timesteps compare as trained at (after ``distill.timestep_shift``)."""
    if key == "distill.regression_teacher_steps" and not value_at(config, "distill.regression_weight"):
        return None
    if key.startswith("distill.gan_") and value is None:  # saved before the GAN loss existed: it was off
        return 0.0
    if key == "distill.student_timesteps":  # the times trained at: shifted (a checkpoint without the key: as given)
        return shifted_times(value, value_at(config, "distill.timestep_shift") or 1.0)
    return value


def dataset_identity(path: str | None) -> str | None:
    """What a dataset is, whatever its path's spelling: a folder's energon index uuid (``energon prepare``
    writes a new one each time it indexes), a metadataset file's checksum; None if neither can be read."""
    if not path:
        return None
    path = Path(path)
    try:
        if path.is_file():
            return "sha256 " + hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        uuid = path / ".nv-meta" / "index.uuid"
        return f"energon index {uuid.read_text().strip()}" if uuid.is_file() else None
    except OSError:
        return None


def dataset_change(common: dict, saved: dict, now: dict) -> list[str]:
    """``dataset.path``: by identity where the checkpoint recorded one, else by the resolved path."""
    key = "dataset.path"
    old, new = value_at(saved, key), value_at(now, key)
    old_id, new_id = common.get(DATASET_ID), dataset_identity(new)
    if old_id is not None and new_id is not None:
        return [] if old_id == new_id else [f"{key}: checkpoint {old!r} ({old_id}), this run {new!r} ({new_id})"]
    resolved = [os.path.realpath(p) if p else p for p in (old, new)]
    return [] if resolved[0] == resolved[1] else [f"{key}: checkpoint {old!r}, this run {new!r}"]


def read_order_changes(saved: dict, now: dict) -> list[str]:
    """The energon read order's settings that differ (a saved loader state holds a buffer of the old size)."""
    with_defaults = [
        {
            key: (config.get("dataset") or {}).get(key.partition(".")[2], before)
            for key, before in READ_ORDER_KEYS.items()
        }
        for config in (saved, now)
    ]
    return [
        f"{key}: checkpoint {with_defaults[0][key]!r}, this run {with_defaults[1][key]!r}"
        for key in READ_ORDER_KEYS
        if with_defaults[0][key] != with_defaults[1][key]
    ]


def differences(saved: dict, now: dict, keys: tuple[str, ...], resolve=None) -> list[str]:
    """``"<key>: checkpoint <old>, this run <new>"`` for each key whose value differs."""
    found = []
    for key in keys:
        old, new = value_at(saved, key), value_at(now, key)
        if resolve is not None:
            old, new = resolve(saved, key, old), resolve(now, key, new)
        if old != new:
            found.append(f"{key}: checkpoint {old!r}, this run {new!r}")
    return found


def value_at(config: dict[str, Any], key: str) -> Any:
    section, _, name = key.partition(".")
    return (config.get(section) or {}).get(name)


def resolved_decay_iters(config: dict, key: str, value: Any) -> Any:
    """The decay length as the schedule uses it: ``scheduler.lr_decay_iters``, else ``train.train_iters``."""
    if key == "scheduler.lr_decay_iters" and value is None:
        return value_at(config, "train.train_iters")
    return value
