"""dfm.platform.compat in this process: install/uninstall restore every original, install is
idempotent, a patch whose megatron source changed fails naming itself, CUDA gets only the
device-independent patches."""

import importlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dfm.platform import compat
from dfm.platform.compat import loader_reads, registry
from dfm.platform.compat.patch import MISSING, Patch, PatchSourceMismatch, _raw_attribute, _resolve, written_for

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def not_installed():
    """Each test starts and ends with megatron unpatched (the suite may share this process)."""
    was_installed = compat.is_installed()
    compat.uninstall()
    yield
    compat.uninstall()
    if was_installed:
        compat.install()


def _bound_objects(patches=registry.PATCHES):
    """Every object a patch replaces: the target's raw attribute and its by-name aliases."""
    objects = {}
    for patch in patches:
        owner_path, _, name = patch.attribute.rpartition(".")
        owner = _resolve(patch.module, owner_path)
        aliases = [importlib.import_module(module) for module in patch.also_bound_in]
        objects[patch.name] = [_raw_attribute(owner, name), *(getattr(alias, name, MISSING) for alias in aliases)]
    return objects


def _same_objects(before, after):
    return {name: all(a is b for a, b in zip(before[name], after[name])) for name in before}


def test_install_replaces_and_uninstall_restores_every_original():
    before = _bound_objects()
    compat.install()
    patched = _bound_objects()
    applicable = {patch.name for patch in compat.applicable_patches()}
    unchanged = [name for name, same in _same_objects(before, patched).items() if same and name in applicable]
    assert not unchanged, f"install left these targets as they were: {unchanged}"
    compat.uninstall()
    restored = _same_objects(before, _bound_objects())
    assert all(restored.values()), [name for name, same in restored.items() if not same]
    assert not compat.is_installed()


def test_install_is_idempotent():
    compat.install()
    first = _bound_objects()
    compat.install()
    assert all(_same_objects(first, _bound_objects()).values())
    with compat.installed():  # already installed: leaves it installed
        pass
    assert compat.is_installed()


def test_loader_patches_apply_once_and_uninstall_restores_them():
    before = _bound_objects(loader_reads.LOADER_PATCHES)
    compat.install_loader_patches()
    patched = _bound_objects(loader_reads.LOADER_PATCHES)
    assert not any(_same_objects(before, patched).values())
    compat.install_loader_patches()
    assert all(_same_objects(patched, _bound_objects(loader_reads.LOADER_PATCHES)).values())
    compat.uninstall()
    assert all(_same_objects(before, _bound_objects(loader_reads.LOADER_PATCHES)).values())


def test_context_manager_restores():
    before = _bound_objects()
    with compat.installed():
        assert compat.is_installed()
    assert all(_same_objects(before, _bound_objects()).values())


def _changed_source_patch(
    module: str = "megatron.core.tensor_parallel.random", attribute: str = "CudaRNGStatesTracker.fork"
) -> Patch:
    """A patch of ``module.attribute`` relying on a line its source never had."""
    return Patch(
        name="example-renamed-site",
        module=module,
        attribute=attribute,
        why="example",
        relies_on=("a line megatron never had",),
        replace=lambda original: original,
    )


def test_changed_source_fails_naming_the_patch_and_target():
    with pytest.raises(PatchSourceMismatch) as error:
        _changed_source_patch().apply()
    message = str(error.value)
    assert "'example-renamed-site'" in message
    assert "megatron.core.tensor_parallel.random.CudaRNGStatesTracker.fork" in message
    assert "a line megatron never had" in message and "registry.py" in message


def test_a_mismatch_names_the_package_the_patch_targets():
    """A loader patch's message names multistorageclient's distribution and version, not megatron-core's."""
    patch = _changed_source_patch("multistorageclient.providers.base", "BaseStorageProvider._emit_metrics")
    with pytest.raises(PatchSourceMismatch, match="written for multi-storage-client 1.3.1") as error:
        patch.apply()
    assert "megatron-core" not in str(error.value) and "compat/loader_reads.py" in str(error.value)


def test_every_patch_names_the_package_it_was_written_for():
    compat_dir = REPO_ROOT / "dfm" / "platform" / "compat"
    for records, patches in (("registry.py", registry.PATCHES), ("loader_reads.py", loader_reads.LOADER_PATCHES)):
        for patch in patches:
            target = written_for(patch.module)
            assert target.distribution and target.version and target.records == records, patch.name
            assert (compat_dir / target.records).is_file()


def test_failed_install_leaves_megatron_untouched(monkeypatch):
    monkeypatch.setattr(registry, "PATCHES", (*registry.PATCHES, _changed_source_patch()))
    before = _bound_objects()
    with pytest.raises(PatchSourceMismatch, match="example-renamed-site"):
        compat.install()
    assert not compat.is_installed()
    assert all(_same_objects(before, _bound_objects()).values())


def test_on_cuda_only_device_independent_patches(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    compat.install()
    import megatron.core.utils

    assert megatron.core.utils.torch is torch
    assert {patch.name for patch in compat.applicable_patches()} == CUDA_PATCHES


# What dfm changes in megatron-core on a GPU, by name (README's platform row names them): a patch
# added to or dropped from this list is a decision, not a side effect of its cpu_only flag.
CUDA_PATCHES = {
    "async-save-results-queue",
    "distrib-optimizer-param-states",
    "distrib-optimizer-set-param-states",
    "distrib-optimizer-step-copy",
    "foreach-l2-norm",
    "megatron-fsdp-root-hooks",
    "megatron-fsdp-stand-in-parameters",
    "megatron-fsdp-te-linear",
    "no-dynamo-import:SGD.step",
    "no-dynamo-import:Adam.step",
    "no-dynamo-import:add_param_group",
    "no-dynamo-import:load_state_dict",
    "no-dynamo-import:state_dict",
    "no-dynamo-import:zero_grad",
    "safe-checkpoint-metadata",
    "safe-checkpoint-objects",
    "safe-checkpoint-objects-named",
    "safe-common-state",
}


def test_importing_the_layer_does_not_import_megatron():
    code = "import sys\nimport dfm.platform, dfm.platform.compat\nassert 'megatron.core' not in sys.modules\n"
    subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), check=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU RNG tracker")
def test_rng_tracker_fork_runs_megatrons_fork_without_the_cpu_state_warning(caplog):
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    def draw_in_fork():
        tracker = CudaRNGStatesTracker()
        tracker.add("stream", 7)
        with tracker.fork("stream"):
            return torch.rand(3)

    compat.install()
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING):
        forked = draw_in_fork()
    default = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(draw_in_fork(), forked)
    assert torch.equal(torch.rand(3), default), "the fork moved the default stream"
    assert not torch.equal(forked, default)
    assert not [record for record in caplog.records if "CPU RNG state changed" in record.getMessage()]


def test_the_foreach_gradient_norm_is_megatrons_fallback_norm_bit_for_bit():
    """``foreach-l2-norm``: the norm megatron's local fallback computes (a torch.norm per tensor, their
    values as a tensor, its norm), without reading each to the host; a fused kernel is left alone."""
    from megatron.core.utils import local_multi_tensor_l2_norm

    from dfm.platform.compat.optimizer import foreach_l2_norm, multi_tensor_l2_norm

    gen = torch.Generator().manual_seed(0)
    for _ in range(10):
        sizes = torch.randint(1, 5000, (50,), generator=gen).tolist()
        scales = torch.randint(-4, 4, (50,), generator=gen).tolist()
        grads = [torch.randn(n, generator=gen) * 10.0**k for n, k in zip(sizes, scales)]
        fallback = torch.norm(torch.tensor([[torch.norm(g) for g in grads]]))  # local_multi_tensor_l2_norm's
        norm, _ = multi_tensor_l2_norm(2048 * 32, None, [grads], False)
        assert torch.equal(norm, fallback.reshape(1))
    assert foreach_l2_norm(local_multi_tensor_l2_norm) is multi_tensor_l2_norm

    def fused(*args):
        return args

    assert foreach_l2_norm(fused) is fused


def test_the_grad_norm_alone_is_megatrons_without_the_one_rank_reduce(monkeypatch):
    """``grad-norm-alone``: megatron's L2 norm bit for bit (its fallback norm, squared, rooted), the group's
    all-reduce left out on a group of one rank and made on a larger one."""
    import megatron.core.optimizer.clip_grads as clip_grads

    from dfm.platform.compat.optimizer import l2_grad_norm_alone_skips_the_reduce, multi_tensor_l2_norm

    monkeypatch.setattr(clip_grads, "l2_norm_impl", multi_tensor_l2_norm)
    reduced = []
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: group)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, op=None, group=None: reduced.append(group))
    norm = l2_grad_norm_alone_skips_the_reduce(clip_grads.get_grad_norm_fp32)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) * 10.0**k for n, k in [(7, -3), (300, 0), (41, 2)]]
    expected = (multi_tensor_l2_norm(0, None, [grads], False)[0] ** 2.0).item() ** 0.5
    assert norm(grads, grad_stats_parallel_group=1) == expected and reduced == []
    assert norm(grads, grad_stats_parallel_group=2) == expected and reduced == [2]
    assert norm([], grad_stats_parallel_group=1) == 0.0


def test_clipping_scales_as_megatron_and_checks_the_dtype():
    """``clip-grads-dtype-check``: grads scaled in place by max_norm / (total + 1e-6) as megatron's
    ``local_multi_tensor_scale`` does (bit for bit), untouched when that is >= 1; a non-fp32 grad refused."""
    import megatron.core.optimizer.clip_grads as clip_grads

    from dfm.platform.compat.optimizer import clip_checking_dtypes

    clip = clip_checking_dtypes(clip_grads.clip_grad_by_total_norm_fp32)
    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3, 2))]
    for param in params:
        param.grad = torch.randn_like(param)
    before = [param.grad.clone() for param in params]
    clip(params, max_norm=1.0, total_norm=0.5)
    assert all(torch.equal(param.grad, grad) for param, grad in zip(params, before))
    clip(params, max_norm=1.0, total_norm=4.0)
    coeff = 1.0 / (4.0 + 1.0e-6)
    assert all(torch.equal(param.grad, grad * coeff) for param, grad in zip(params, before))
    half = torch.nn.Parameter(torch.randn(4).half())
    half.grad = torch.randn(4).half()
    params.append(half)
    with pytest.raises(AssertionError, match="float16"):
        clip(params, max_norm=1.0, total_norm=4.0)
