"""Wan 2.2 A14B fine-tuning through the real entry point (torchrun, tiny model, mock data), from the
import of a two-transformer pipeline folder (checkpoint.pretrained):

* both experts in one run (``model.wan_expert=both``) at TP=2 + SP, and at DP=2 with the distributed
  optimizer and overlapped gradient reduction: losses finite and falling, each expert's loss and
  sample count logged, the same as one process; the TP=2 run's export is a pipeline folder
  WanPipeline loads holding exactly the run's weights;
* one expert (the low-noise one; test_wan22_experts.py runs the high-noise one) at TP=2: losses
  finite and falling; exported with the high-noise import, WanPipeline loads it.
"""

import json
import math

import diffusers
import pytest
import torch

from dfm.convert.pretrained import read_full_weights
from dfm.convert.rules import to_dfm
from dfm.convert.wan import rules
from tests.training.entry import read_metrics, run_entry, run_in_one_launch
from tests.wan.test_wan22_experts import BOUNDARY, TINY_TEXT, WAN_TINY, experts, run_cli

ITERS = 8
ABSENT = dict.fromkeys(("tokenizer", "text_encoder", "vae", "scheduler"))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """The import of a tiny two-transformer folder: <root>/high_noise, <root>/low_noise."""
    folder = tmp_path_factory.mktemp("a14b") / "pipeline"
    for transformer, name in zip(experts(), ("transformer", "transformer_2")):
        transformer.save_pretrained(folder / name)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "boundary_ratio": BOUNDARY}))
    run_cli(["import", "--diffusers", folder, "--output", folder.parent / "ckpt", *TINY_TEXT])
    return folder.parent / "ckpt"


def finetune_overrides(run, pretrained, expert: str, extra=()) -> list[str]:
    return [
        f"checkpoint.pretrained={pretrained}",
        f"model.wan_expert={expert}",
        f"model.wan_boundary_ratio={BOUNDARY}",
        f"train.train_iters={ITERS}",
        "optimizer.lr=1e-3",
        f"logger.log_dir={run / 'logs'}",
        *TINY_TEXT,
        *extra,
    ]


def finetune(nproc: int, run, pretrained, expert: str, extra=()) -> list[dict]:
    result = run_entry(nproc, finetune_overrides(run, pretrained, expert, extra), config=WAN_TINY, mock=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return read_metrics(run / "logs")


def falling(losses: list[float]) -> bool:
    """Finite, and the last three steps' mean below 0.9 x the first three's (t is drawn anew each step)."""
    return all(math.isfinite(x) for x in losses) and sum(losses[-3:]) < 0.9 * sum(losses[:3])


def assert_exported(out, run_checkpoints, expert_modules) -> None:
    """WanPipeline loads ``out`` and holds the run's weights: {pipeline attribute: (prefix in the run, None)}."""
    pipe = diffusers.WanPipeline.from_pretrained(out, torch_dtype=torch.float32, **ABSENT)
    assert pipe.config.boundary_ratio == BOUNDARY
    cfg, trained = read_full_weights(run_checkpoints)
    for attribute, prefix in expert_modules.items():
        loaded = to_dfm(getattr(pipe, attribute).state_dict(), rules(cfg.model))
        ours = {name[len(prefix) :]: t for name, t in trained.items() if name.startswith(prefix)}
        assert loaded.keys() == ours.keys() and all(torch.equal(loaded[k], ours[k]) for k in ours), attribute


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_both_experts_finetune_at_tp2_and_dp2_like_one_process_and_export_to_wan_pipeline(imported, tmp_path):
    run = tmp_path / "tp2"
    save = [f"checkpoint.save={run / 'checkpoints'}", f"checkpoint.save_interval={ITERS}"]
    shift = ["flow.shift=5"]  # Wan's: about a third of the samples are the high-noise expert's (t >= 0.875)
    layout = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]
    # DP=2, the distributed optimizer, overlapped reduction: the ranks' packs route differently.
    sharded = ["ddp.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=true"]
    runs = [finetune_overrides(run, imported, "both", layout + save + shift)]
    runs.append(finetune_overrides(tmp_path / "dp2", imported, "both", sharded + shift))
    run_in_one_launch(2, runs, tmp_path / "launch", config=WAN_TINY)  # the two 2-rank runs
    tp2, dp2 = read_metrics(run / "logs"), read_metrics(tmp_path / "dp2" / "logs")
    one = finetune(1, tmp_path / "tp1", imported, "both", shift)
    losses = [m["loss"] for m in tp2]
    assert len(losses) == ITERS and falling(losses), losses
    for ours, reference in [*zip(tp2, one), *zip(dp2, one)]:
        for key in ("loss", "loss_high_noise", "loss_low_noise"):
            if reference[key] is None:
                assert ours[key] is None
            else:
                assert abs(ours[key] - reference[key]) <= 1e-4 * abs(reference[key]), (key, ours, reference)
        assert (ours["samples_high_noise"], ours["samples_low_noise"]) == (
            reference["samples_high_noise"],
            reference["samples_low_noise"],
        )
    counts = [(m["samples_high_noise"], m["samples_low_noise"]) for m in tp2]
    assert all(high > 0 and low > 0 for high, low in counts), counts
    out = tmp_path / "export"
    run_cli(["export", "--checkpoint", run / "checkpoints", "--output", out])
    assert_exported(out, run / "checkpoints", {"transformer": "high_noise.", "transformer_2": "low_noise."})


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_one_expert_finetunes_at_tp2_and_exports_with_the_other(imported, tmp_path):
    run = tmp_path / "low"
    save = [f"checkpoint.save={run / 'checkpoints'}", f"checkpoint.save_interval={ITERS}"]
    metrics = finetune(2, run, imported / "low_noise", "low_noise", ["model.tensor_model_parallel_size=2", *save])
    losses = [m["loss"] for m in metrics]
    assert len(losses) == ITERS and falling(losses), losses
    out = tmp_path / "export"
    run_cli(["export", "--checkpoint", imported / "high_noise", "--checkpoint_2", run / "checkpoints", "--output", out])
    assert_exported(out, run / "checkpoints", {"transformer_2": ""})
