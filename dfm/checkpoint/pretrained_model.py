"""``checkpoint.pretrained`` brings its model: the architecture a run starts from is the checkpoint's.

A fine-tune names the weights and its own training settings; the model section comes from the
checkpoint's saved config, key by key, except where the user's config file or overrides set a key
(a mismatch there is refused when the weights load, naming the key) and except how the model runs
on this machine (parallel sizes, attention backend, recompute, compile, dropout, init).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from megatron.core import dist_checkpointing

from dfm.checkpoint.select import choose_checkpoint, log_rank0
from dfm.config.container import ConfigContainer, ModelConfig
from dfm.diffusion.timestep_experts import EXPERTS
from dfm.parallel.layout import CONFIG_FIELDS

logger = logging.getLogger("dfm.checkpoint")

# Model keys a run keeps its own of: how it runs here (its layout, and the rest), not what the weights are.
RUN_KEYS = frozenset(CONFIG_FIELDS.values()) | frozenset(
    {
        "attention_backend",
        "recompute_granularity",
        "recompute_method",
        "recompute_num_layers",
        "recompute_activation",
        "compile",
        "hidden_dropout",
        "attention_dropout",
        "init_method_std",
        "moe_aux_loss_coeff",
    }
)


def saved_model_section(path: str | Path) -> dict[str, Any] | None:
    """The model section of the config saved with the checkpoint ``path`` names (a root: its newest
    that is complete; a root of per-expert folders, as Wan 2.2's import writes: the first expert's); None
    when it holds none. No checksums: only the config is read here, the weights' load verifies them."""
    directory = choose_checkpoint(path, checksums=False)
    experts = [Path(path) / name for name in EXPERTS if (Path(path) / name).is_dir()]
    if directory is None and experts:
        directory = choose_checkpoint(experts[0], checksums=False)
    if directory is None:
        return None  # loading the weights names what is missing
    common = dist_checkpointing.load_common_state_dict(str(directory))
    model = (common.get("config") or {}).get("model")
    if model is not None and directory.parent in experts:
        # One expert's config: which expert it was is not the run's (a root of both trains both).
        model = {key: value for key, value in model.items() if key != "wan_expert"}
    return model


def take_pretrained_model(cfg: ConfigContainer, explicit: frozenset[str]) -> list[str]:
    """Set each model key of ``cfg`` to the value saved with ``checkpoint.pretrained``, unless it is a
    run key or ``explicit`` (the keys the user set) holds it -> ``"model.<key>: <was> -> <now>"`` per change."""
    saved = saved_model_section(cfg.checkpoint.pretrained)
    if saved is None:
        log_rank0(logging.WARNING, "checkpoint.pretrained=%s saved no model config", cfg.checkpoint.pretrained)
        return []
    fields = {field.name for field in dataclasses.fields(ModelConfig)}
    changes = []
    for key, value in saved.items():
        if key not in fields or key in RUN_KEYS or f"model.{key}" in explicit:
            continue
        value = tuple(value) if isinstance(getattr(cfg.model, key), tuple) and isinstance(value, list) else value
        if getattr(cfg.model, key) != value:
            changes.append(f"model.{key}: {getattr(cfg.model, key)!r} -> {value!r}")
            setattr(cfg.model, key, value)
    if changes:
        log_rank0(
            logging.INFO, "the model from checkpoint.pretrained=%s: %s", cfg.checkpoint.pretrained, "; ".join(changes)
        )
    return changes
