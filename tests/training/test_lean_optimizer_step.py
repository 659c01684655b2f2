"""The lean optimizer step (dfm/training/lean_optimizer_step.py) is megatron's step, bitwise.

The tiny DiT trained four steps of two micro-batches each, once through ``LeanStep`` and once through
megatron's ``optimizer.step()``, from the same weights and data, with weight decay, an LR warm-up (the
scheduler changes the groups' lr every step) and a clip norm the gradients exceed (so clipping runs):
the grad norms and the weights and Adam moments after each step are bitwise equal. A loaded optimizer
state (new state tensors) is picked up, and what the lean step does not cover goes to megatron's.
"""

from __future__ import annotations

import pytest
import torch

import dfm.training.pretrain as pretrain
from dfm.checkpoint.state import TrainingState
from dfm.config.loader import build_config
from dfm.diffusion.registry import pipeline_from_config
from dfm.parallel import ParallelLayout
from dfm.platform.distributed import destroy_distributed, initialize_distributed
from dfm.training import setup
from dfm.training.data import build_mock_loader
from dfm.training.forward_step import DiffusionForwardStep
from dfm.training.lean_optimizer_step import LeanStep, applies
from dfm.training.pretrain import RecordingIterator, finalize_defaults, train_step
from tests.training.entry import TINY

OVERRIDES = [
    "model.attention_backend=sdpa",
    "train.global_batch_size=2",
    "optimizer.weight_decay=0.1",
    "optimizer.clip_grad=0.05",
    "scheduler.lr_warmup_iters=3",
]


@pytest.fixture(scope="module")
def device():
    yield initialize_distributed()
    destroy_distributed()


def trainer(device, overrides=()):
    cfg = build_config(None, str(TINY), [*OVERRIDES, *overrides])
    layout = ParallelLayout(world_size=1)
    finalize_defaults(cfg, layout)
    torch.manual_seed(0)
    model, tconfig = setup.build_model(cfg, layout, device)
    optimizer, scheduler = setup.build_optimizer(cfg, model, tconfig)
    step = DiffusionForwardStep(pipeline_from_config(cfg), cfg.rng.seed, cfg.dataset.cfg_dropout_prob, device)
    state = TrainingState(model, optimizer, scheduler, RecordingIterator(build_mock_loader(cfg, layout)))
    return step, state, setup.num_microbatches(cfg, layout)


def run(device, lean: bool, steps: int = 4) -> list:
    forward_step, state, n_micro = trainer(device)
    megatron_step = type(state.optimizer).step
    record = []
    with pytest.MonkeyPatch.context() as patch:
        if not lean:  # every step through megatron's own
            patch.setattr(pretrain, "optimizer_step", lambda optimizer: megatron_step(optimizer))
        for iteration in range(1, steps + 1):
            forward_step.iteration = iteration
            _, updated, grad_norm, _ = train_step(forward_step, state, n_micro, device)
            assert updated
            record.append((grad_norm, snapshot(state.optimizer)))
    if lean:  # steps 2-4 took the lean path (step 1 made the Adam state through megatron's)
        assert state.optimizer._lean_step.groups is not None
    return record


def snapshot(optimizer) -> list[torch.Tensor]:
    inner = optimizer.chained_optimizers[0].optimizer
    params = [p for group in inner.param_groups for p in group["params"]]
    moments = [inner.state[p][key] for p in params for key in ("exp_avg", "exp_avg_sq", "step")]
    return [t.detach().clone() for t in (*params, *moments)]


def test_the_lean_step_is_megatrons_bitwise(device):
    lean, megatron = run(device, lean=True), run(device, lean=False)
    clipped = 0
    for (norm_a, tensors_a), (norm_b, tensors_b) in zip(lean, megatron):
        assert norm_a == norm_b
        clipped += norm_a > 0.05
        assert all(torch.equal(a, b) for a, b in zip(tensors_a, tensors_b))
    assert clipped >= 2  # clipping ran


def test_a_loaded_state_is_picked_up(device):
    forward_step, state, n_micro = trainer(device)
    lean = LeanStep(state.optimizer)
    assert lean.inner is not None
    state.optimizer._lean_step = lean
    for iteration in (1, 2):
        forward_step.iteration = iteration
        train_step(forward_step, state, n_micro, device)
    inner = state.optimizer.chained_optimizers[0].optimizer
    inner.load_state_dict(inner.state_dict())  # new groups (a checkpoint's load)
    assert not lean.lists_current()
    forward_step.iteration = 3
    train_step(forward_step, state, n_micro, device)
    assert all(lists.group is group for lists, group in zip(lean.groups, inner.param_groups))
    first = lean.groups[0].params[0]
    inner.state[first]["exp_avg"] = inner.state[first]["exp_avg"].clone()  # a new state tensor
    assert not lean.lists_current()
    forward_step.iteration = 4
    train_step(forward_step, state, n_micro, device)
    assert lean.groups[0].exp_avgs[0] is inner.state[first]["exp_avg"]


def test_what_it_does_not_cover_goes_to_megatron(device):
    _, state, _ = trainer(device)
    assert applies(state.optimizer)
    state.optimizer.chained_optimizers[0].config.log_num_zeros_in_grad = True
    assert not applies(state.optimizer)
    _, state, _ = trainer(device)
    inner = state.optimizer.chained_optimizers[0].optimizer
    handle = inner.register_step_post_hook(lambda *args: None)
    assert not applies(state.optimizer)
    handle.remove()
    assert applies(state.optimizer)
