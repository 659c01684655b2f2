"""EMA weights and async checkpoint saves through the real entry point.

- EMA after one step is ``d * w0 + (1 - d) * w1`` exactly (w0: the layout-independent init,
  w1: the checkpoint's trained weights), and the inference loader picks it when asked.
- Async saves (a forked writer process): ``latest`` moves only once a save is complete, and
  resuming from an async checkpoint is exact (losses bitwise on CPU), EMA included.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from entry import read_metrics, run_entry, run_in_one_launch

from dfm.inference.checkpoint_loading import checkpoint_config, load_model, single_process_config
from dfm.models.build import build_model_chunk
from dfm.platform.distributed import destroy_distributed, initialize_distributed

DECAY = 0.75
DP2 = ["ddp.use_distributed_optimizer=true", "dataset.mock_samples_per_pack=2", f"optimizer.ema_decay={DECAY}"]


def train(tmp: Path, name: str, nproc: int, overrides: list[str]) -> Path:
    log_dir = tmp / name
    result = run_entry(nproc, [*overrides, f"logger.log_dir={log_dir}"])
    assert result.returncode == 0, result.stderr[-4000:]
    return log_dir


def losses(log_dir: Path) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in read_metrics(log_dir)}


@pytest.mark.slow
def test_ema_after_one_step_and_inference_uses_it(tmp_path):
    save = tmp_path / "ckpt"
    train(tmp_path, "one_step", 1, ["train.train_iters=1", f"checkpoint.save={save}", f"optimizer.ema_decay={DECAY}"])
    directory = save / "iter_0000001"
    cfg = single_process_config(checkpoint_config(directory))
    device = initialize_distributed(seed=cfg.rng.seed)
    try:
        initial, _ = build_model_chunk(cfg.model, cfg.mixed_precision.precision, cfg.rng.seed)
        trained = dict(load_model(cfg, directory, device, use_ema=False).named_parameters())
        ema = dict(load_model(cfg, directory, device, use_ema=True).named_parameters())
    finally:
        destroy_distributed()
    moved = 0
    for name, w0 in initial.named_parameters():
        expected = DECAY * w0.detach() + (1 - DECAY) * trained[name]
        torch.testing.assert_close(ema[name], expected, rtol=1e-6, atol=1e-7, msg=name)
        moved += int(not torch.equal(w0, trained[name]))
    assert moved > 0  # the step changed the weights, so EMA differs from both


def ema_weights(directory: Path) -> dict[str, torch.Tensor]:
    cfg = single_process_config(checkpoint_config(directory))
    device = initialize_distributed(seed=0)
    try:
        return {n: p.clone() for n, p in load_model(cfg, directory, device).named_parameters()}
    finally:
        destroy_distributed()


@pytest.mark.slow
def test_async_save_resume_is_exact_with_ema(tmp_path):
    save, resumed_save, straight, resumed = (
        tmp_path / name for name in ("ckpt", "resumed_ckpt", "straight", "resumed")
    )
    async_save = ["checkpoint.async_save=true", "checkpoint.save_interval=3"]
    first = [f"logger.log_dir={straight}", f"checkpoint.save={save}"]
    then = [f"logger.log_dir={resumed}", f"checkpoint.load={save}/iter_0000003", f"checkpoint.save={resumed_save}"]
    common = [*DP2, "train.train_iters=6", *async_save]
    run_in_one_launch(2, [[*common, *first], [*common, *then]], tmp_path / "launch")
    assert (save / "latest").read_text().strip() == "6"
    assert (save / "iter_0000003" / "metadata.json").exists()
    straight_losses = losses(straight)
    assert losses(resumed) == {i: straight_losses[i] for i in (4, 5, 6)}  # bitwise on CPU
    expected, got = ema_weights(save / "iter_0000006"), ema_weights(resumed_save / "iter_0000006")
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[n], got[n]) for n in expected)
