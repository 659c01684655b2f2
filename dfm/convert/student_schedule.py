"""A DMD2 student's schedule beside its exported model: ``scheduler_config.json`` in the export folder.

diffusers' ``FlowMatchEulerDiscreteScheduler.from_pretrained(folder)`` reads it: ``shift`` 1 (the student's
times are used as given) and ``stochastic_sampling`` true, whose step is the student's own (dmd2:
x0 = x - t v, then (1 - t_next) x0 + t_next n with fresh noise n); false is dfm's ``--sampler euler``. The
times themselves have no scheduler key (``set_timesteps(n)`` spaces n times evenly, and WanPipeline takes
no ``sigmas``): they are kept under ``_dfm_student_timesteps``, which diffusers loads into the scheduler's
config untouched, for ``set_timesteps(sigmas=...)`` (docs/distillation.md, "Generation and export").
"""

from __future__ import annotations

import json
from pathlib import Path

from dfm.config.container import ConfigContainer
from dfm.convert.rules import ConversionError

SCHEDULER_CONFIG = "scheduler_config.json"
TIMESTEPS_KEY = "_dfm_student_timesteps"
NUM_TRAIN_TIMESTEPS = 1000  # diffusers' timestep = 1000 t, the Wan / FLUX c_noise_scale


def student_scheduler_config(cfg: ConfigContainer) -> dict:
    """The scheduler_config.json of ``cfg``'s student (``distill.enabled``)."""
    import diffusers

    return {
        "_class_name": "FlowMatchEulerDiscreteScheduler",
        "_diffusers_version": diffusers.__version__,
        "num_train_timesteps": NUM_TRAIN_TIMESTEPS,
        "shift": 1.0,
        "stochastic_sampling": True,
        TIMESTEPS_KEY: list(cfg.distill.settings().student_timesteps),
    }


def write_student_schedule(folder: Path, cfg: ConfigContainer) -> None:
    """``scheduler_config.json`` into the export ``folder`` when ``cfg`` is a student's; else nothing."""
    if not cfg.distill.enabled:
        return
    if cfg.flow.c_noise_scale != NUM_TRAIN_TIMESTEPS or cfg.flow.sigma_min != 0:
        raise ConversionError(
            f"a student with flow.c_noise_scale={cfg.flow.c_noise_scale}, flow.sigma_min={cfg.flow.sigma_min}: "
            f"diffusers' flow schedulers take timestep {NUM_TRAIN_TIMESTEPS} t and no sigma_min"
        )
    (folder / SCHEDULER_CONFIG).write_text(json.dumps(student_scheduler_config(cfg), indent=2) + "\n")
