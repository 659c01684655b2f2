"""diffusers' own model of a folder, for ``--verify``: fp32, loaded one tensor at a time.

Parameters are created on meta (accelerate's ``init_empty_weights``; buffers such as rotary tables
are built as usual) and each is set from the folder as it is read, so no random model exists and
the folder's tensors are never all in memory beside the model.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from dfm.convert.diffusers_folder import DiffusersWeights, read_config
from dfm.convert.rules import ConversionError

Outputs = TypeVar("Outputs")


@torch.no_grad()
def load_diffusers_model(path: str | Path, diffusers_class: str) -> torch.nn.Module:
    """``<diffusers_class>`` of the model or pipeline folder ``path`` in fp32, eval mode."""
    import accelerate
    import diffusers
    from accelerate.utils import set_module_tensor_to_device

    config = read_config(path, diffusers_class)
    with accelerate.init_empty_weights():
        model = getattr(diffusers, diffusers_class).from_config(config)
    weights = DiffusersWeights(path)
    expected = set(model.state_dict())
    unknown = sorted(set(weights.names()) - expected)
    if unknown:
        raise ConversionError(
            f"{weights.folder}: {len(unknown)} tensor(s) {diffusers_class} does not have: {unknown[:8]}"
        )
    for name in weights.names():
        set_module_tensor_to_device(model, name, "cpu", value=weights.read(name), dtype=torch.float32)
    missing = sorted(name for name, tensor in model.state_dict().items() if tensor.is_meta)
    if missing:
        raise ConversionError(f"{weights.folder}: missing {len(missing)} tensor(s) of {diffusers_class}: {missing[:8]}")
    return model.eval()


def diffusers_outputs_alone(
    path: str | Path, diffusers_class: str, run: Callable[[torch.nn.Module], Outputs]
) -> Outputs:
    """``run(model)`` on ``load_diffusers_model(path, diffusers_class)``; the model is gone (collected)
    when this returns, so dfm's model, built next, is never in memory together with it."""
    model = load_diffusers_model(path, diffusers_class)
    outputs = run(model)
    del model
    gc.collect()
    return outputs
