"""Loading: choose a checkpoint that verifies, check it fits this run's model, restore everything."""

from __future__ import annotations

import logging
from pathlib import Path

from megatron.core import dist_checkpointing

from dfm.checkpoint.compare import model_differences
from dfm.checkpoint.errors import CheckpointError
from dfm.checkpoint.progress import StageProgress
from dfm.checkpoint.run_settings import compare_run_settings, data_kind, restore_schedule
from dfm.checkpoint.select import choose_checkpoint
from dfm.checkpoint.state import (
    COMPANIONS,
    WEIGHTS_ONLY,
    CheckpointState,
    Companion,
    TrainingState,
    full_sharded_state_dict,
    layout,
    restore_ema,
    restore_model_and_optimizer,
    set_rng_state,
)
from dfm.config.container import ConfigContainer, ModelConfig
from dfm.platform.compat.checkpointing import ensure_adam_state, unshare_adam_steps
from dfm.platform.optimizer_steps import step_parameters_together

logger = logging.getLogger("dfm.checkpoint")

LOAD_STAGES = ["plan", "read tensors", "model", "optimizer + EMA + schedule", "RNG + data position"]


def load_checkpoint(
    path: str, run: TrainingState, model_config: ModelConfig | None = None, run_config: ConfigContainer | None = None
) -> int:
    """Restore ``run`` from ``path`` (a checkpoint, or a root: its newest that verifies); -> iteration (0 if none).

    With ``model_config``, a checkpoint of a different architecture is refused before any tensor is read;
    with ``run_config``, changed data settings too (dfm/checkpoint/run_settings.py).
    """
    directory = choose_checkpoint(path)
    if directory is None:
        return 0
    model, optimizer, scheduler, loader, ema = run.model, run.optimizer, run.scheduler, run.loader, run.ema
    with StageProgress(f"load {directory.name}", LOAD_STAGES) as progress:
        common = dist_checkpointing.load_common_state_dict(str(directory))
        if common.get(WEIGHTS_ONLY):
            raise CheckpointError(
                f"checkpoint {directory} holds model weights only (no optimizer or schedule): start a run from it "
                f"with checkpoint.pretrained={path}; checkpoint.load resumes training checkpoints"
            )
        if model_config is not None:
            check_same_model(common, directory, model_config)
        resume = compare_run_settings(common, directory, run_config, data_kind(loader))
        ensure_adam_state(optimizer)
        same_layout = common.get("layout") == layout(model)
        same_dp = common.get("layout", {}).get("dp") == layout(model)["dp"]
        ema_saved = ema if common.get("has_ema") else None
        keep_data = same_dp and resume.data_position
        checkpoint = full_sharded_state_dict(
            model, optimizer, loader, is_loading=True, with_rng=same_layout, with_data=keep_data, ema=ema_saved
        )
        companions = companion_requests(run.companions, common, directory)
        checkpoint.state.update({name: part.state for name, part in companions.items()})
        progress.advance()
        loaded = dist_checkpointing.load(checkpoint.state, str(directory))
        progress.advance()
        restore_model_and_optimizer(checkpoint, model, optimizer, loaded)
        progress.advance()
        unshare_adam_steps(optimizer)
        step_parameters_together(optimizer)
        restore_ema(ema, loaded if ema_saved is not None else None, model, directory, checkpoint)
        restore_schedule(scheduler, optimizer, loaded["scheduler"], resume)
        for name, part in companions.items():
            restore_companion(run.companions[name], part, loaded[name], resume)
        progress.advance()
        if same_layout:
            set_rng_state(loaded["rng"])
        if "data" in loaded:
            loader.load_state_dict(loaded["data"])
        elif not same_dp:
            logger.warning(
                "checkpoint %s was written with data-parallel size %s, now %s: the data position is not restored",
                directory,
                common.get("layout", {}).get("dp"),
                layout(model)["dp"],
            )
        progress.advance()
    logger.info("loaded checkpoint %s (iteration %d)", directory, loaded["iteration"])
    return int(loaded["iteration"])


def companion_requests(companions: dict[str, Companion], common: dict, directory: Path) -> dict[str, CheckpointState]:
    """What to read of each companion (a distillation's critic); one the checkpoint lacks is refused by name."""
    missing = [name for name in companions if name not in common.get(COMPANIONS, [])]
    if missing:
        raise CheckpointError(
            f"checkpoint {directory} holds no {', '.join(missing)}: this run trains it beside the model "
            "(distill.enabled=true), so it resumes only a checkpoint of such a run; "
            "checkpoint.pretrained starts one from a model's weights"
        )
    for companion in companions.values():
        ensure_adam_state(companion.optimizer)
    return {name: companion.sharded_state(name, is_loading=True) for name, companion in companions.items()}


def restore_companion(companion: Companion, part: CheckpointState, loaded: dict, resume) -> None:
    """A companion's model, optimizer and schedule from what ``companion_requests`` asked for."""
    restore_model_and_optimizer(part, companion.model, companion.optimizer, loaded)
    unshare_adam_steps(companion.optimizer)
    step_parameters_together(companion.optimizer)
    restore_schedule(companion.scheduler, companion.optimizer, loaded["scheduler"], resume)


RESUME_HINT = (
    "Set these keys to the checkpoint's values to resume it (parallel sizes may differ), "
    "or start a new run with another checkpoint.save directory"
)
PRETRAINED_HINT = (
    "Leave these keys unset (in the config file and the overrides) to take the checkpoint's, or set them to its values"
)


def check_same_model(common: dict, directory: Path, current: ModelConfig, hint: str = RESUME_HINT) -> None:
    """Raise naming every architecture key whose value differs from the checkpoint's (then ``hint``)."""
    saved = (common.get("config") or {}).get("model")
    if saved is None:
        logger.warning("checkpoint %s holds no model config: its architecture is not compared", directory)
        return
    differences = model_differences(saved, current)
    if differences:
        raise CheckpointError(
            f"checkpoint {directory} holds a different model than this run: {'; '.join(differences)}. {hint}"
        )
