"""Gradients straight into megatron's buffer (dfm/training/buffer_grads.py) are megatron's gradients.

The tiny DiT trained two steps of two micro-batches each, once as built (megatron's per-parameter hooks
removed, autograd adding into the buffer; its one-member grad all-reduce skipped) and once as megatron
has it (hooks and all-reduce): the grad buffers, the grad norms and the weights after each step are
bitwise equal.
"""

from __future__ import annotations

import pytest
import torch

import dfm.training.setup as setup
from dfm.checkpoint.state import TrainingState
from dfm.config.loader import build_config
from dfm.diffusion.registry import pipeline_from_config
from dfm.parallel import ParallelLayout
from dfm.platform.distributed import destroy_distributed, initialize_distributed
from dfm.training.buffer_grads import _MEGATRON_HOOK
from dfm.training.data import build_mock_loader
from dfm.training.forward_step import DiffusionForwardStep
from dfm.training.pretrain import RecordingIterator, finalize_defaults, train_step
from tests.training.entry import TINY


@pytest.fixture(scope="module")
def device():
    yield initialize_distributed()
    destroy_distributed()


def trainer(device, as_megatron: bool):
    cfg = build_config(None, str(TINY), ["model.attention_backend=sdpa", "train.global_batch_size=2"])
    layout = ParallelLayout(world_size=1)
    finalize_defaults(cfg, layout)
    with pytest.MonkeyPatch.context() as patch:
        if as_megatron:
            patch.setattr(setup, "accumulate_into_buffers", lambda *args: [])
            patch.setattr(setup, "skip_sync_alone", lambda chunk: None)
        model, tconfig = setup.build_model(cfg, layout, device)
    optimizer, scheduler = setup.build_optimizer(cfg, model, tconfig)
    step = DiffusionForwardStep(pipeline_from_config(cfg), cfg.rng.seed, cfg.dataset.cfg_dropout_prob, device)
    state = TrainingState(model, optimizer, scheduler, RecordingIterator(build_mock_loader(cfg, layout)))
    return step, state, setup.num_microbatches(cfg, layout)


def megatron_hooks(param: torch.nn.Parameter) -> int:
    node = param.expand_as(param).grad_fn.next_functions[0][0]
    probe = node.register_hook(lambda *_: None)
    hooks = probe.hooks_dict_ref()
    probe.remove()
    return sum(_MEGATRON_HOOK in getattr(fn, "__qualname__", "") for fn in hooks.values())


def test_buffer_grads_equal_megatron_hooks(device):
    direct, hooked = trainer(device, False), trainer(device, True)
    chunk = direct[1].model[0]
    params = [p for p in chunk.module.parameters() if p.requires_grad]
    assert chunk.buffer_grad_params and len(chunk.buffer_grad_params) == len(params)
    assert all(megatron_hooks(p) == 0 for p in params)
    assert all(megatron_hooks(p) == 1 for p in hooked[1].model[0].module.parameters() if p.requires_grad)
    assert direct[2] == hooked[2] == 2
    assert "finish_grad_sync" in vars(chunk) and "finish_grad_sync" not in vars(hooked[1].model[0])
    for iteration in (1, 2):
        results = []
        for step, state, n_micro in (direct, hooked):
            step.iteration = iteration
            losses, updated, grad_norm, _ = train_step(step, state, n_micro, device)
            assert updated
            chunk = state.model[0]
            buffers = [buffer.grad_data.clone() for buffer in chunk.buffers]
            results.append((grad_norm, buffers, [p.detach().clone() for p in chunk.module.parameters()]))
        (norm_a, grads_a, weights_a), (norm_b, grads_b, weights_b) = results
        assert norm_a == norm_b
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
        assert all(torch.equal(a, b) for a, b in zip(weights_a, weights_b))
        assert any(g.abs().sum() > 0 for g in grads_a)


def test_bf16_parameters_keep_megatron_hooks():
    """A bf16 parameter's fp32 main_grad cannot be its .grad: it is left to megatron's hook."""
    from dfm.training.buffer_grads import _same_layout

    param = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    param.main_grad = torch.zeros(3)
    assert not _same_layout(param)
    param.main_grad = torch.zeros(3, dtype=torch.bfloat16)
    assert _same_layout(param)
