"""The finite check and the preemption flag of a training step cost one all-reduce and one host read.

A real step of the tiny DiT (the trainer's model, optimizer, loader and ``train_step``) in a
one-process gloo group; every ``all_reduce`` is recorded with the file that called it, and
the losses play a device tensor that records each read back to the host.
"""

from __future__ import annotations

import signal
import traceback

import pytest
import torch

from dfm.checkpoint.state import TrainingState
from dfm.config.loader import build_config
from dfm.diffusion.registry import pipeline_from_config
from dfm.parallel import ParallelLayout
from dfm.platform.distributed import destroy_distributed, initialize_distributed
from dfm.training.data import build_mock_loader
from dfm.training.faults import PreemptionSignal
from dfm.training.forward_step import DiffusionForwardStep
from dfm.training.pretrain import RecordingIterator, finalize_defaults, train_step
from dfm.training.setup import build_model, build_optimizer, num_microbatches
from tests.models.test_no_host_sync import DeviceTensor, package_path
from tests.training.entry import TINY


def direct_caller() -> str:
    """The file that called ``all_reduce`` (dfm's relative to the package; megatron's grad reductions too)."""
    caller = traceback.extract_stack()[-3].filename
    return package_path(caller) or caller


@pytest.fixture(scope="module")
def trainer():
    device = initialize_distributed()
    cfg = build_config(None, str(TINY), ["model.attention_backend=sdpa"])
    layout = ParallelLayout(world_size=1)
    finalize_defaults(cfg, layout)
    model, tconfig = build_model(cfg, layout, device)
    optimizer, scheduler = build_optimizer(cfg, model, tconfig)
    step = DiffusionForwardStep(pipeline_from_config(cfg), cfg.rng.seed, cfg.dataset.cfg_dropout_prob, device)
    data = RecordingIterator(build_mock_loader(cfg, layout))
    yield step, data, model, optimizer, scheduler, num_microbatches(cfg, layout), device
    destroy_distributed()


class FakeDeviceLoss:
    """Wraps the forward step: its losses are device tensors that record reads back to the host."""

    def __init__(self, step, nonfinite: bool):
        self.step, self.nonfinite = step, nonfinite

    def __call__(self, data_iter, model):
        output, loss_fn = self.step(data_iter, model)

        def device_loss(tensor):
            loss, stats = loss_fn(tensor)
            value = stats["loss_and_tokens"].as_subclass(DeviceTensor)
            if self.nonfinite:
                value = value * float("nan")
            return loss, {"loss_and_tokens": value}

        return output, device_loss


@pytest.mark.parametrize("alone", [False, True])
@pytest.mark.parametrize("nonfinite, signalled", [(False, False), (True, True)])
def test_one_all_reduce_and_one_read_agree_on_finite_and_preemption(trainer, monkeypatch, nonfinite, signalled, alone):
    """With peers (the one-process group playing them) the flags take one all-reduce; alone, none."""
    from dfm.training import faults

    step, data, model, optimizer, scheduler, n_micro, device = trainer
    monkeypatch.setattr(faults, "alone", lambda: alone)
    calls: list[str] = []
    real_all_reduce = torch.distributed.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        calls.append(direct_caller())
        return real_all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.distributed, "all_reduce", recording_all_reduce)
    preemption = PreemptionSignal(enabled=False)
    if signalled:
        preemption._handle(signal.SIGTERM, None)
    DeviceTensor.reads = []
    step.iteration = 1
    state = TrainingState(model, optimizer, scheduler, data)
    _, updated, _, preempt = train_step(FakeDeviceLoss(step, nonfinite), state, n_micro, device, preemption)
    assert (updated, preempt) == (not nonfinite, signalled)
    assert [c for c in calls if c.startswith("training/")] == ([] if alone else ["training/faults.py"]), calls
    reads = [read for read in DeviceTensor.reads if " at training/" in read]
    assert len(reads) == 1 and reads[0].startswith("tolist at training/faults.py"), DeviceTensor.reads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [None, "nan", "inf", "-inf", "both infs"])
def test_finite_check_sees_any_non_finite_element(dtype, bad):
    """One NaN or inf anywhere in a gradient buffer (both infinities at once too) is seen, in every
    precision a buffer has; a buffer of large finite fp16 values is finite (summed in fp32)."""
    from dfm.training import faults

    grads = torch.full((1000,), 60000.0, dtype=dtype)
    if bad == "both infs":
        grads[3], grads[700] = float("inf"), float("-inf")
    elif bad is not None:
        grads[999] = float(bad)
    assert bool(faults.all_finite(grads)) == (bad is None)


def test_finite_check_counts_an_fp32_overflowing_sum_as_non_finite():
    """Documented: elements whose sum passes fp32's range (their norm is inf too) skip the step."""
    from dfm.training import faults

    assert not bool(faults.all_finite(torch.full((4,), 3e38)))
