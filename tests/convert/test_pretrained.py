"""Weights-only checkpoints: written from full tensors in one process, read back exactly, and the
start of a training run at another layout (``checkpoint.pretrained``), through the real entry point."""

from __future__ import annotations

import pytest
import torch
import yaml

from dfm.config.recipes import get_recipe
from dfm.convert.pretrained import read_full_weights, save_pretrained_checkpoint
from dfm.convert.weights import single_process_world
from dfm.models.build import build_model
from tests.parallel.equivalence import WEIGHTS_ENTRY
from tests.training.entry import run_entries, run_entry


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


@pytest.mark.slow
def test_pretrained_brings_its_model_unless_the_user_sets_a_key(tmp_path):
    """A fine-tune of the tiny recipe from a 3-layer, 96-wide checkpoint trains the checkpoint's model
    (its weights exactly, lr 0); with model.hidden_size set in the overrides the start is refused naming
    the key. Mutation: taking no key from the checkpoint (every key treated as the user's) fails the first run (checked
    2026-11-28)."""
    cfg = get_recipe("dit_tiny")
    cfg.model.num_layers, cfg.model.hidden_size = 3, 96
    weights = random_weights(cfg)
    root = tmp_path / "wide"
    save_pretrained_checkpoint(cfg, weights, root)
    # The recipe alone (no config file): no model key is the user's own.
    argv = ["--recipe", "dit_tiny", "--mock", "train.train_iters=1", "optimizer.lr=0", "optimizer.min_lr=0"]
    argv.append(f"checkpoint.pretrained={root}")
    taken, refused = tmp_path / "taken", tmp_path / "refused"
    runs = [
        {"argv": [*argv, f"logger.log_dir={taken}"], "weights": str(taken / "weights.pt")},
        {"argv": [*argv, "model.hidden_size=64", f"logger.log_dir={refused}"], "weights": None},
    ]
    ok, failure = run_entries(1, runs, tmp_path / "runs")
    assert ok == "ok", ok
    saved = yaml.safe_load((taken / "config.yaml").read_text())["model"]
    assert (saved["num_layers"], saved["hidden_size"]) == (3, 96)
    trained = torch.load(taken / "weights.pt")
    assert sorted(trained) == sorted(weights) and all(torch.equal(trained[k], v) for k, v in weights.items())
    assert "model.hidden_size: checkpoint 96, this run 64" in failure, failure[-3000:]
