"""A micro-batch's device work never waits for the device.

``DiffusionForwardStep.run`` (model input, model forward, loss) and the backward pass run on a
pack whose tensors are wrapped in ``DeviceTensor``, a CPU tensor that plays the device's part:
every tensor computed from it is one too, and each operation that would copy a device value
back to the host (``.item()``, ``.tolist()``, ``int()``, ``.cpu()``, boolean-mask indexing,
``nonzero``, ``repeat_interleave`` without ``output_size``, ...) is recorded with where it was
called. Host-side layout work reads the pack's host original (``PackedBatch.host``) instead.
On CUDA the same calls would each stall the CPU until the GPU queue drains.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch

import dfm
from dfm.data.packed_batch import PackedBatch
from dfm.diffusion.registry import build_pipeline
from dfm.training.forward_step import DiffusionForwardStep
from tests.models._helpers import build_random_model, make_samples, pack_samples, tiny_config

READS_BACK = {
    "tolist",
    "item",
    "__int__",
    "__float__",
    "__bool__",
    "__index__",
    "cpu",
    "numpy",
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
    "unique_consecutive",
    "bincount",
    "equal",
    "allclose",
}


def _reads_back(func, args, kwargs) -> bool:
    name = getattr(func, "__name__", "")
    if name in READS_BACK:
        return True
    if name == "repeat_interleave":  # its output size is the repeats' sum, unless given
        return (
            isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor)
            and kwargs.get("output_size") is None
        )
    if name in ("__getitem__", "__setitem__", "index_put", "index_put_"):  # a boolean mask is a nonzero
        index = args[1] if len(args) > 1 else None
        indices = index if isinstance(index, (tuple, list)) else (index,)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
    if name == "to":  # a literal "cpu" (on the fake device, x.to(y.device) is a no-op as on CUDA)
        return any(isinstance(a, str) and a.startswith("cpu") for a in (*args[1:], kwargs.get("device")))
    return False


PACKAGE = Path(dfm.__file__).resolve().parent


def package_path(filename: str) -> str | None:
    """``filename`` relative to the dfm package (``training/faults.py``), None outside it; whatever the
    clone's folder is called (a clone named ``dfm`` holds ``dfm/tests/...`` too)."""
    path = Path(filename).resolve()
    return path.relative_to(PACKAGE).as_posix() if path.is_relative_to(PACKAGE) else None


class DeviceTensor(torch.Tensor):
    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_back(func, args, kwargs):
            frames = [f for f in traceback.extract_stack()[:-1] if package_path(f.filename)]
            where = f"{package_path(frames[-1].filename)}:{frames[-1].lineno}" if frames else "?"
            cls.reads.append(f"{getattr(func, '__name__', func)} at {where}")
        return super().__torch_function__(func, types, args, kwargs)


def on_fake_device(batch: PackedBatch) -> PackedBatch:
    """The pack as ``.to(device)`` returns it: device tensors, the host original kept."""
    tensors = {
        name: value.clone().as_subclass(DeviceTensor)
        for name, value in vars(batch).items()
        if name != "host" and value is not None
    }
    return PackedBatch(**tensors, host=batch.host_view())


@pytest.mark.parametrize("arch", ["dit_cross", "dit_adaln", "stdit", "moviegen"])
@pytest.mark.parametrize("pipeline", ["edm", "flow"])
def test_micro_batch_device_work_never_reads_back(dist, arch, pipeline):
    cfg = tiny_config(arch, attention_backend="sdpa")
    model = build_random_model(cfg)
    step = DiffusionForwardStep(build_pipeline(pipeline), seed=1, cfg_dropout_prob=0.5, device=torch.device("cpu"))
    batch, noise, level = step.prepare(pack_samples(make_samples(cfg), segment_multiple=8))
    noise, level = noise.as_subclass(DeviceTensor), level.as_subclass(DeviceTensor)
    DeviceTensor.reads = []

    output, loss_fn = step.run(model, on_fake_device(batch), noise, level)
    loss, _ = loss_fn(output)
    loss.backward()

    assert DeviceTensor.reads == [], "\n".join(DeviceTensor.reads)
    assert all(p.grad is not None for p in model.parameters())


def test_the_detector_sees_reads_back(dist):
    DeviceTensor.reads = []
    ids = torch.tensor([0, 0, 1]).as_subclass(DeviceTensor)
    ids.tolist(), int(ids.max()), ids[ids > 0], torch.repeat_interleave(ids, ids)
    torch.repeat_interleave(ids, ids, output_size=1)
    assert [read.split(" ")[0] for read in DeviceTensor.reads] == [
        "tolist",
        "__int__",
        "__getitem__",
        "repeat_interleave",
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["dit_cross", "moviegen"])
def test_micro_batch_on_cuda_never_syncs(dist, arch):
    """The same on a real GPU: CUDA's sync debug mode turns every synchronising call into an error.
    The first micro-batch compiles FlexAttention's kernels and runs outside the mode.
    (Not yet run on a GPU.)"""
    cfg = tiny_config(arch)
    model = build_random_model(cfg).cuda()
    step = DiffusionForwardStep(build_pipeline("edm"), seed=1, cfg_dropout_prob=0.5, device=torch.device("cuda"))
    for debug_mode in ("default", "error"):
        batch, noise, level = step.prepare(pack_samples(make_samples(cfg), segment_multiple=8))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(debug_mode)
        try:
            output, loss_fn = step.run(model, batch, noise, level)
            loss_fn(output)[0].backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("arch", ["dit_cross", "stdit"])
def test_attention_plans_are_built_once_per_pack_not_per_layer(dist, monkeypatch, arch):
    """Every layer reads the same segments object, so the sdpa kernel's plan (segment_plan.py) is
    built once per attention kind per pack shape, forward and backward: as often for 3 layers as for 1."""
    from dfm.models.attention import segment_plan

    builds = []
    plan = segment_plan.plan_segments
    monkeypatch.setattr(segment_plan, "plan_segments", lambda *a: builds.append(1) or plan(*a))
    counts = []
    for layers in (1, 3):
        cfg = tiny_config(arch, attention_backend="sdpa", num_layers=layers)
        model = build_random_model(cfg)
        step = DiffusionForwardStep(build_pipeline("flow"), seed=1, cfg_dropout_prob=0.5, device=torch.device("cpu"))
        batch, noise, level = step.prepare(pack_samples(make_samples(cfg), segment_multiple=8))
        builds.clear()
        segment_plan._plan_of_bounds.cache_clear()  # a pack of this shape was planned for the 1-layer model
        output, loss_fn = step.run(model, batch, noise, level)
        loss_fn(output)[0].backward()
        counts.append(len(builds))
    assert counts[0] == counts[1] > 0
