"""Layout equivalence through the real entry point: train 3 optimizer steps in a parallel layout
and in one process from the same seed and data, and compare losses, gradient norms and updated
weights (the cases: test_layout_equivalence.py, test_fsdp_layouts.py); the DiT runs then compute
their validation losses per level and their validation sample at their layout, compared with the
one-process ones.

Each run dumps every parameter gathered to its full tensor under its global name
(``_weights_entry.py``: TP shards concatenated, pipeline stages and expert-parallel ranks
merged, replicas checked bitwise equal), and the test compares all of them with the
single-process run's. A layout runs on tp x pp x cp processes, or on 2 (data parallel) when
that product is 1. The runs a session selects are made several per launch (``LayoutRuns``): one launch
per process count and test, so each pays Python's and megatron-core's start-up once.

Tolerances:
* losses rel 1e-4, grad norms rel 1e-3: float sums in a different order.
* weights atol 1e-6 (lr 1e-3, 3 Adam steps: updates ~3e-3 on weights up to ~0.3). Dense layouts
  agree far inside it (TP=2+SP: max |diff| 7e-9); a layout bug moves weights by ~lr (a missing
  SP gradient reduction in adaLN was found this way: 1.5e-3).
* validation loss per level (2 levels, the same 2 held-out packs): rel 1e-5.
* validation sample: every element within 1e-5 of the sample's largest magnitude. 2 Heun steps of
  EDM from sigma 80 leave values up to ~124, whose fp32 rounding is ~1e-5 absolute; the layouts measured
  0 to 7.6e-5 absolute (at most 6e-7 of the largest magnitude; FSDP with TP=2+SP the largest). A
  layout bug (a stage's output not broadcast, a CP rank sampling another share) is off by O(1).
* Adam's eps is 1e-4 in these runs (ADAM_EPS), not 1e-8: an update is lr g / (|g| + eps), so an element
  whose gradient sums to ~eps from larger terms turns the layouts' ~1e-8 gradient rounding into
  lr 1e-8 / eps of weight. At eps 1e-8 that is up to ~lr: FLUX at CP=2 under FSDP moved 55 elements by
  up to 1e-4 while its gradients agree to 4e-8 (checked with eps 1 and lr 1, i.e. updates ~ gradients);
  at 1e-4 the same run agrees to 4e-8. Elements with |g| >> 1e-4 still take Adam's steps.
* MoE with EP=2 x DP=2 agrees to ~1e-8 since the mock loader forms packs over the global
  stream (dfm/data/mock.py): the load-balancing loss is computed per pack, so DP=2 must train
  on the same packs as one process with 2 micro-batches, not only on the same samples.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.training.entry import RECIPE_DIR, read_metrics, run_entries, run_entry

WEIGHTS_ENTRY = Path(__file__).resolve().parent / "_weights_entry.py"

WEIGHT_ATOL = 1e-6
SAMPLE_TOL = 1e-5  # the validation sample after training, relative to its largest magnitude (docstring)
VAL_LOSS_RTOL = 1e-5  # the validation loss per level after training
# Sampled after training (tests/training/_runs_entry.py save_validation_sample) at each of its layouts:
# TP=2+SP, PP=2 (and virtual), CP=2, their combinations, the distributed optimizer and Megatron-FSDP.
SAMPLED_CONFIGS = {"dit_tiny"}
ADAM_EPS = "optimizer.adam_eps=1e-4"  # see the docstring: rounding, not Adam, is what is compared
DP_DATA = ["dataset.mock_samples_per_pack=2", "train.global_batch_size=2"]  # same samples for DP=1 and DP=2
# Gradient accumulation: 2 micro-batches per DP rank and step (4 on the single process).
ACCUMULATE = ["dataset.mock_samples_per_pack=2", "train.global_batch_size=4"]
TP2, PP2, SP = (
    "model.tensor_model_parallel_size=2",
    "model.pipeline_model_parallel_size=2",
    "model.sequence_parallel=true",
)
DIST_OPT = "ddp.use_distributed_optimizer=true"
# Virtual pipeline: 4 layers in 2 chunks per stage (megatron's interleaved 1F1B schedule), with the
# 4 accumulated micro-batches so both stages also run its steady state, not only warm-up/cool-down.
VPP = ["model.num_layers=4", PP2, "model.virtual_pipeline_model_parallel_size=2", *ACCUMULATE]
CP2 = "model.context_parallel_size=2"
EP2 = "model.expert_model_parallel_size=2"
FP8 = "mixed_precision.fp8=hybrid"  # the block linears' products in FP8: each amax reduced as one process's
FSDP = ["ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params"]
FLUX_TINY = "../../flux/conf/flux_tiny"  # conf paths are relative to the DiT recipe's conf/
HUNYUAN_TINY = "../../hunyuan/conf/hunyuan_tiny"


@dataclass
class Run:
    metrics: list[dict]
    weights: dict[str, torch.Tensor]
    sample: torch.Tensor | None = None  # the validation sample after training (DP rank 0's latent)
    val_losses: list[float] | None = None  # the validation loss per level after training


def world_size(layout: list[str]) -> int:
    sizes = dict(item.split("=", 1) for item in layout)
    model_parallel = math.prod(
        int(sizes.get(f"model.{kind}_parallel_size", 1)) for kind in ("tensor_model", "pipeline_model", "context")
    )
    return model_parallel if model_parallel > 1 else 2


def train(tmp: Path, config: str, nproc: int, overrides: list[str]) -> Run:
    log_dir = tmp / f"{Path(config).name}-{nproc}-{abs(hash(tuple(overrides)))}"
    conf = RECIPE_DIR / "conf" / f"{config}.yaml"
    weights = log_dir / "full_weights.pt"
    args = ["train.train_iters=3", f"logger.log_dir={log_dir}", *overrides]
    result = run_entry(nproc, args, entry=WEIGHTS_ENTRY, env={"DFM_TEST_FULL_WEIGHTS": str(weights)}, config=conf)
    assert result.returncode == 0, result.stderr[-4000:]
    return Run(read_metrics(log_dir), torch.load(weights))


def train_many(tmp: Path, nproc: int, cases: list[tuple[str, list[str]]]) -> list[Run | str]:
    """``train`` of each (config, overrides) on ``nproc`` processes, several per launch
    (tests/training/_runs_entry.py) -> each case's Run, or its failure."""
    runs, log_dirs = [], []
    for index, (config, overrides) in enumerate(cases):
        log_dir = tmp / f"{Path(config).name}-{nproc}-{index}"
        conf = RECIPE_DIR / "conf" / f"{config}.yaml"
        argv = ["--config-file", str(conf), "--mock", "train.train_iters=3", ADAM_EPS, f"logger.log_dir={log_dir}"]
        argv += overrides
        sample = str(log_dir / "sample") if config in SAMPLED_CONFIGS else None
        runs.append({"argv": argv, "weights": str(log_dir / "full_weights.pt"), "sample": sample})
        log_dirs.append(log_dir)
    statuses = run_entries(nproc, runs, tmp / f"launch-{nproc}")
    return [finished_run(log_dir) if status == "ok" else status for status, log_dir in zip(statuses, log_dirs)]


def finished_run(log_dir: Path) -> Run:
    """The run's metrics and full weights, and for a validated run (``SAMPLED_CONFIGS``) its validation
    loss per level (the last line of validation.jsonl) and DP rank 0's sample."""
    sample = log_dir / "sample" / "validation_generation" / "iter_0000000_dp0.pt"
    latent, losses = None, None
    if sample.exists():
        latent = torch.load(sample)["latent"]
        record = json.loads((log_dir / "validation.jsonl").read_text().splitlines()[-1])
        losses = [record[f"val_loss_t{k}"] for k in range(len(record["val_levels"]))]
    return Run(read_metrics(log_dir), torch.load(log_dir / "full_weights.pt"), latent, losses)


Case = tuple[str, int, tuple[str, ...]]  # (config, processes, overrides)


class LayoutRuns:
    """The session's training runs by (config, processes, overrides), made on first use together with
    the other runs on as many processes that the requesting test's selected cases need."""

    def __init__(self, tmp: Path):
        self.tmp, self.done, self.launches = tmp, {}, 0

    def get(self, config: str, nproc: int, overrides: list[str], batch: list[Case]) -> Run:
        case = (config, nproc, tuple(overrides))
        if case not in self.done:
            pending = [c for c in dict.fromkeys([case, *batch]) if c[1] == nproc and c not in self.done]
            self.launches += 1
            folder = self.tmp / f"batch{self.launches}"
            results = train_many(folder, nproc, [(c[0], list(c[2])) for c in pending])
            self.done.update(zip(pending, results))
        result = self.done[case]
        if isinstance(result, str):
            pytest.fail(f"the run of {case} failed:\n{result}", pytrace=False)
        return result


def selected_params(request) -> list[dict]:
    """The parameters of every case of the requesting test function that this session runs."""
    node = request.node
    return [
        item.callspec.params
        for item in request.session.items
        if getattr(item, "originalname", None) == node.originalname and item.module is node.module
    ]


def assert_same_metrics(expected: list[dict], actual: list[dict]) -> None:
    assert [r["iteration"] for r in actual] == [1, 2, 3]
    for ref, got in zip(expected, actual):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4), (ref["iteration"], ref["loss"], got["loss"])
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3), (
            ref["iteration"],
            ref["grad_norm"],
            got["grad_norm"],
        )


def assert_same_validation(expected: Run, actual: Run) -> None:
    """The validation loss per level at the layout equals the one-process one (rel ``VAL_LOSS_RTOL``), and
    so does its sample: every element within ``SAMPLE_TOL`` of the sample's largest magnitude (fp32); runs
    of ``SAMPLED_CONFIGS`` only (None: not validated)."""
    assert (actual.sample is None) == (expected.sample is None)
    if expected.sample is None:
        return
    assert actual.val_losses == pytest.approx(expected.val_losses, rel=VAL_LOSS_RTOL)
    assert actual.sample.shape == expected.sample.shape
    atol = SAMPLE_TOL * expected.sample.abs().max().item()
    torch.testing.assert_close(actual.sample, expected.sample, rtol=0, atol=atol)


def assert_same_weights(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, ref in expected.items():
        assert actual[name].shape == ref.shape, (name, actual[name].shape, ref.shape)
        torch.testing.assert_close(actual[name], ref, rtol=0, atol=WEIGHT_ATOL, msg=lambda m, n=name: f"{n}: {m}")
