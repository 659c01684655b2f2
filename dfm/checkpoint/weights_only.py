"""Checkpoints that hold model weights only: written by ``convert import``, read by ``checkpoint.pretrained``.

A weights-only checkpoint has the same files, manifest and global tensor names as a training one,
so it loads into any TP / PP / CP layout; it has no optimizer, schedule, RNG or data position.
``checkpoint.pretrained`` reads the model part of either kind and starts a new run from it.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from megatron.core import dist_checkpointing

from dfm.checkpoint.collective import barrier, rank
from dfm.checkpoint.errors import CheckpointError
from dfm.checkpoint.files import iteration_dir, remove_partial
from dfm.checkpoint.load import PRETRAINED_HINT, check_same_model
from dfm.checkpoint.save import failures_named, finalize_save
from dfm.checkpoint.select import choose_checkpoint
from dfm.checkpoint.state import WEIGHTS_ONLY, layout, model_sharded_state_dict
from dfm.config.container import ModelConfig
from dfm.config.peft import is_adapter_param

logger = logging.getLogger("dfm.checkpoint")


def save_weights_only(root: str | Path, model_chunks, config_dict: dict, extra: dict | None = None) -> Path:
    """Write ``<root>/iter_0000000`` holding the (unwrapped) chunks' weights and ``config_dict`` (+ ``extra``
    plain values in the common state, e.g. the converter's record of the source dtype); all ranks."""
    target = iteration_dir(root, 0)
    if rank() == 0:
        remove_partial(target)
        target.mkdir(parents=True)
    barrier()
    state = {f"model{index}": model_sharded_state_dict(chunk) for index, chunk in enumerate(model_chunks)}
    state.update(iteration=0, config=config_dict, layout=layout(model_chunks), has_ema=False, **{WEIGHTS_ONLY: True})
    state.update(extra or {})
    with failures_named(target):
        dist_checkpointing.save(state, str(target))
    finalize_save(str(root), 0, keep_last=None)
    return target


def base_weights(state: dict) -> dict:
    """``state`` without LoRA adapters: what a pretrained (base) checkpoint provides."""
    return {key: value for key, value in state.items() if not is_adapter_param(key)}


def load_pretrained(path: str | Path, model, model_config: ModelConfig | None = None) -> Path:
    """Fill the DDP-wrapped ``model`` chunks with the model weights of the checkpoint at ``path`` (any layout).

    A different architecture (width, depth, ...) is refused naming the keys; nothing else is restored.
    A model of submodels (both Wan 2.2 experts) also loads from a root holding one checkpoint per
    submodel, in folders of their names (what the import of a two-transformer pipeline writes).
    """
    directory = choose_checkpoint(path)
    if directory is None and hasattr(model[0].module, "submodels"):
        for name, submodel in model[0].module.submodels().items():
            one = None if model_config is None else dataclasses.replace(model_config, wan_expert=name)
            load_weights(choose_checkpoint(Path(path) / name), [submodel], one, f"{path}/{name}")
        return Path(path)
    load_weights(directory, [chunk.module for chunk in model], model_config, path)
    return directory


def load_weights(directory: Path | None, modules: list, model_config: ModelConfig | None, path) -> None:
    """The model weights of the checkpoint ``directory`` into the unwrapped chunks ``modules``."""
    if directory is None:
        raise CheckpointError(f"checkpoint.pretrained={path}: no complete checkpoint there")
    common = dist_checkpointing.load_common_state_dict(str(directory))
    if model_config is not None:
        check_same_model(common, directory, model_config, PRETRAINED_HINT)
    request = {f"model{index}": base_weights(model_sharded_state_dict(module)) for index, module in enumerate(modules)}
    loaded = dist_checkpointing.load(request, str(directory))
    for index, module in enumerate(modules):
        # strict but for LoRA adapters (dfm/peft): a base checkpoint has none, they keep their init
        missing, unexpected = module.load_state_dict(loaded[f"model{index}"], strict=False)
        if unexpected or [key for key in missing if not is_adapter_param(key)]:
            raise CheckpointError(
                f"{directory} does not fit the model: missing {missing[:8]}, unexpected {unexpected[:8]}"
            )
    if rank() == 0:
        logger.info("initial weights from %s (checkpoint.pretrained; optimizer and schedule start fresh)", directory)
