"""Checkpoints that hold model weights only: written by ``convert import``, read by ``checkpoint.pretrained``.

A weights-only checkpoint has the same files, manifest and global tensor names as a training one,
so it loads into any TP / PP / CP layout; it has no optimizer, schedule, RNG or data position.
``checkpoint.pretrained`` reads the model part of either kind and starts a new run from it.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from megatron.core import dist_checkpointing

from dfm.checkpoint import fsdp_state
from dfm.checkpoint.collective import barrier, rank
from dfm.checkpoint.errors import CheckpointError
from dfm.checkpoint.files import iteration_dir, remove_partial
from dfm.checkpoint.load import PRETRAINED_HINT, check_same_model
from dfm.checkpoint.pieces import without_empty
from dfm.checkpoint.save import failures_named, finalize_save
from dfm.checkpoint.select import choose_checkpoint
from dfm.checkpoint.state import WEIGHTS_ONLY, layout, model_sharded_state_dict
from dfm.config.container import ModelConfig
from dfm.config.peft import is_adapter_param
from dfm.models.common.sample_classifier import is_classifier_param
from dfm.parallel.fsdp_shards import install_main_weights

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
    """``state`` without LoRA adapters and a critic's GAN classifier: what a pretrained (base) checkpoint provides."""
    return {key: value for key, value in state.items() if not added_param(key)}


def added_param(key: str) -> bool:
    """A parameter a run adds to the pretrained model (LoRA adapters, dfm/peft; the GAN classifier of a
    distillation's critic): not in a base checkpoint, it keeps its initialisation."""
    return is_adapter_param(key) or is_classifier_param(key)


def load_pretrained(path: str | Path, model, model_config: ModelConfig | None = None) -> Path:
    """Fill the DDP- or FSDP-wrapped ``model`` chunks with the model weights of the checkpoint at ``path`` (any layout).

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
    if fsdp_state.is_fsdp(model[0]):
        load_fsdp_weights(directory, model, model_config, path)
    else:
        load_weights(directory, [chunk.module for chunk in model], model_config, path)
    return directory


def load_weights(directory: Path | None, modules: list, model_config: ModelConfig | None, path) -> None:
    """The model weights of the checkpoint ``directory`` into the unwrapped chunks ``modules``."""
    check_model_fits(directory, model_config, path)
    request = {f"model{index}": base_weights(model_sharded_state_dict(module)) for index, module in enumerate(modules)}
    loaded = dist_checkpointing.load(request, str(directory))
    for index, module in enumerate(modules):
        # strict but for what a run adds (base_weights): a base checkpoint has none, they keep their init
        missing, unexpected = module.load_state_dict(loaded[f"model{index}"], strict=False)
        if unexpected or [key for key in missing if not added_param(key)]:
            raise CheckpointError(
                f"{directory} does not fit the model: missing {missing[:8]}, unexpected {unexpected[:8]}"
            )
    log_loaded(directory)


def load_fsdp_weights(directory: Path | None, model, model_config: ModelConfig | None, path) -> None:
    """The model weights of the checkpoint ``directory`` into Megatron-FSDP chunks: each rank reads only its
    rows of every parameter, in the model's dtype (as a DDP chunk's weights are read), into its main-weight
    shards (the optimizer's weights under FSDP), then the compute weights follow them. As a resume does,
    only parameters are read (no extra states)."""
    check_model_fits(directory, model_config, path)
    chunks_rows = [
        fsdp_state.main_rows(chunk, fsdp_state.model_templates(chunk, model_sharded_state_dict)) for chunk in model
    ]
    # LoRA adapters (dfm/peft) are not in a base checkpoint: they keep their init.
    chunks_rows = [base_weights(rows) for rows in chunks_rows]
    read = [{name: model_dtype_rows(rows) for name, rows in chunk_rows.items()} for chunk_rows in chunks_rows]
    request = {
        f"model{index}": without_empty(
            {name: rows.piece.sharded(rows.piece.template.key, read[index][name]) for name, rows in chunk_rows.items()}
        )
        for index, chunk_rows in enumerate(chunks_rows)
    }
    loaded = dist_checkpointing.load(request, str(directory))
    with torch.no_grad():
        for index, chunk_rows in enumerate(chunks_rows):
            for name, rows in chunk_rows.items():
                rows.piece.fill(read[index][name], loaded.get(f"model{index}", {}).get(name, []))
                rows.main.copy_(read[index][name])  # a no-op copy onto itself where the dtypes agree
    install_main_weights(model)
    log_loaded(directory)


def model_dtype_rows(rows: fsdp_state.MainRows) -> torch.Tensor:
    """Where to read a parameter's rows: the main weight itself when it has the model's dtype, else a buffer."""
    if rows.main.dtype == rows.dtype:
        return rows.main
    return torch.empty(rows.main.shape, dtype=rows.dtype, device=rows.main.device)


def check_model_fits(directory: Path | None, model_config: ModelConfig | None, path) -> None:
    """A complete checkpoint at ``directory`` saved by the same architecture as ``model_config`` (None: unchecked)."""
    if directory is None:
        raise CheckpointError(f"checkpoint.pretrained={path}: no complete checkpoint there")
    if model_config is not None:
        common = dist_checkpointing.load_common_state_dict(str(directory))
        check_same_model(common, directory, model_config, PRETRAINED_HINT)


def log_loaded(directory: Path) -> None:
    if rank() == 0:
        logger.info("initial weights from %s (checkpoint.pretrained; optimizer and schedule start fresh)", directory)
