"""Weights-only checkpoints: written from full tensors in one process, read back exactly, and the
start of a training run at another layout (``checkpoint.pretrained``), through the real entry point."""

from __future__ import annotations

import pytest
import torch

from dfm.config.recipes import get_recipe
from dfm.convert.pretrained import read_full_weights, save_pretrained_checkpoint
from dfm.convert.weights import single_process_world
from dfm.models.build import build_model
from tests.parallel.equivalence import WEIGHTS_ENTRY
from tests.training.entry import run_entry


def random_weights(cfg) -> dict[str, torch.Tensor]:
    """Every parameter of ``cfg``'s model under its global name, drawn at random (not dfm's init)."""
    with single_process_world(cfg.rng.seed):
        model, _ = build_model(cfg.model, cfg.mixed_precision.precision)
        names = {model.global_param_name(n): p.shape for n, p in model.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator) * 0.05 for name, shape in names.items()}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    cfg = get_recipe("dit_tiny")
    weights = random_weights(cfg)
    root = tmp_path_factory.mktemp("pretrained")
    save_pretrained_checkpoint(cfg, weights, root)
    return root, weights


def test_weights_only_checkpoint_reads_back_bit_exact(pretrained):
    root, weights = pretrained
    cfg, back = read_full_weights(root)
    assert cfg.model.architecture == "dit_cross"
    assert sorted(back) == sorted(weights)
    assert all(torch.equal(back[name], tensor) for name, tensor in weights.items())


@pytest.mark.slow
def test_training_starts_from_pretrained_at_tp2_and_refuses_it_as_resume(pretrained, tmp_path):
    root, weights = pretrained
    dump = tmp_path / "weights.pt"
    # lr 0: after one step the weights are still exactly the pretrained ones, on a layout they were not saved in.
    args = ["train.train_iters=1", "optimizer.lr=0", "optimizer.min_lr=0", f"logger.log_dir={tmp_path / 'log'}"]
    args += ["model.tensor_model_parallel_size=2", f"checkpoint.pretrained={root}"]
    result = run_entry(2, args, entry=WEIGHTS_ENTRY, env={"DFM_TEST_FULL_WEIGHTS": str(dump)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "checkpoint.pretrained" in result.stderr
    trained = torch.load(dump)
    assert sorted(trained) == sorted(weights)
    for name, tensor in weights.items():
        assert torch.equal(trained[name], tensor), name

    resume = run_entry(1, ["train.train_iters=1", f"checkpoint.load={root}", f"logger.log_dir={tmp_path / 'r'}"])
    assert resume.returncode != 0
    assert "holds model weights only" in resume.stderr and "checkpoint.pretrained=" in resume.stderr
