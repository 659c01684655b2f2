"""LoRA on Wan 2.2 A14B's experts through the real entry point (one process, tiny model, mock data),
from the import of a tiny two-transformer pipeline folder:

* one expert (the low-noise one): ``export-lora`` writes a file that ``WanPipeline.load_lora_weights(...,
  load_into_transformer_2=True)`` loads into transformer_2 (transformer untouched), and that pipeline
  gives the outputs of ``export --merge-lora`` (with the high-noise import) loaded as a plain pipeline;
* both experts in one run (``model.wan_expert=both``): each expert gets its own adapters (drawn by
  their prefixed names), only adapters train (gradients and optimizer state: the measured bytes are
  the formula's), an expert without samples in a pack gets zero adapter gradients; the loss falls;
  ``export-lora`` writes ``transformer/`` and ``transformer_2/``, which WanPipeline loads into its two
  transformers, equal to ``export --merge-lora``'s pipeline folder; at TP=2 + SP, and at DP=2 with
  the distributed optimizer and overlapped reduction, the run's losses,
  per-expert losses and gradient norms are one process's (1e-4 relative), its adapters too (TP-split,
  saved at their global offsets), the base untouched.
"""

import contextlib
import dataclasses
import io
import math

import diffusers
import pytest
import torch

from dfm.config.peft import PeftConfig
from dfm.convert.pretrained import read_full_weights
from dfm.convert.wan import diffusers_sample_output, parity_samples, parity_timesteps, rules
from dfm.diffusion.registry import build_pipeline
from dfm.peft.inject import add_lora
from tests.models.conftest import dist  # noqa: F401
from tests.peft.test_lora_memory import assert_measured_matches_formula
from tests.wan._tiny import TEXT_LEN, tiny_model_config
from tests.wan.test_wan22_both_experts import LEVELS, SHAPES, both_model, packed
from tests.wan.test_wan22_experts import experts, run_cli
from tests.wan.test_wan22_finetune_entry import ABSENT, BOUNDARY, finetune, imported  # noqa: F401

TOLERANCE = 1e-5
# 6 Adam steps at lr 3e-2 move the adapters by up to ~0.2; Adam's normalisation turns the TP sums'
# rounding of near-zero gradient entries into isolated differences (measured 1.2e-4 in 1 of 192
# entries, most tensors <= 2e-6; losses and gradient norms within 2e-7 relative).
ADAPTER_ATOL = 5e-4
ITERS = 6
# Fused (q/k/v: q and v only), row-parallel, cross-attention k of k/v and MLP targets.
TARGETS = ["to_q", "to_v", "to_out.0", "attn2.to_k", "ffn.net.0.proj"]
LORA = [
    "peft.lora_rank=4",
    "peft.lora_alpha=8",
    f"peft.target_modules=[{','.join(TARGETS)}]",
    f"train.train_iters={ITERS}",
    "optimizer.lr=1e-2",
]


def lora_run(tmp_path, pretrained, expert: str, extra=(), nproc: int = 1) -> tuple:
    """(metrics, checkpoint root) of a LoRA run of ``expert`` from ``pretrained`` on ``nproc`` processes."""
    run = tmp_path / expert
    save = [f"checkpoint.save={run / 'checkpoints'}", f"checkpoint.save_interval={ITERS}"]
    return finetune(nproc, run, pretrained, expert, [*LORA, *save, *extra]), run / "checkpoints"


def base_pipeline() -> diffusers.WanPipeline:
    """The two-transformer pipeline the import was made from."""
    high, low = experts()
    return diffusers.WanPipeline(
        tokenizer=None, text_encoder=None, vae=None, scheduler=None, transformer=high, transformer_2=low
    )


@torch.no_grad()
def outputs(transformer) -> list[torch.Tensor]:
    """``transformer`` on three fixed samples at fixed timesteps."""
    samples = parity_samples(tiny_model_config())
    return [diffusers_sample_output(transformer, s, t, TEXT_LEN) for s, t in zip(samples, parity_timesteps(3))]


def falls(losses: list[float]) -> bool:
    """Finite, the last three steps' mean below 0.95 x the first three's (t is drawn anew each step; a
    few adapter steps move the loss less than test_wan22_finetune_entry's full fine-tune's 0.9)."""
    return all(math.isfinite(x) for x in losses) and sum(losses[-3:]) < 0.95 * sum(losses[:3])


def max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def assert_loaded_equals_merged(pipe, merged, trained: dict[str, bool]) -> None:
    """Each transformer of ``pipe`` (LoRA loaded) gives ``merged``'s outputs; ``trained``: {attribute:
    whether it got a LoRA}, the LoRA changing its outputs, the others holding none."""
    base = base_pipeline()
    for attribute, lora in trained.items():
        ours, theirs = getattr(pipe, attribute), getattr(merged, attribute)
        assert bool(getattr(ours, "peft_config", None)) == lora, attribute
        expected = outputs(theirs)
        assert max_diff(outputs(ours), expected) <= TOLERANCE, attribute
        moved = max_diff(outputs(getattr(base, attribute)), expected)
        assert (moved > 100 * TOLERANCE) == lora, (attribute, moved)


def export(argv) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        run_cli(argv)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_one_expert_lora_loads_into_its_transformer_and_equals_the_merged_export(imported, tmp_path):  # noqa: F811
    metrics, ckpt = lora_run(tmp_path, imported / "low_noise", "low_noise")
    assert len(metrics) == ITERS and all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    export(["export-lora", "--checkpoint", ckpt, "--output", tmp_path / "lora"])
    merged_out = tmp_path / "merged"
    export(
        [
            "export",
            "--merge-lora",
            "--checkpoint",
            imported / "high_noise",
            "--checkpoint_2",
            ckpt,
            "--output",
            merged_out,
        ]
    )
    pipe = base_pipeline()
    pipe.load_lora_weights(str(tmp_path / "lora"), load_into_transformer_2=True)
    merged = diffusers.WanPipeline.from_pretrained(merged_out, torch_dtype=torch.float32, **ABSENT)
    assert merged.config.boundary_ratio == BOUNDARY
    assert_loaded_equals_merged(pipe, merged, {"transformer": False, "transformer_2": True})


@pytest.mark.filterwarnings("ignore")
def test_both_experts_get_their_own_adapters_and_one_without_samples_zero_gradients(dist):  # noqa: F811
    cfg, model = both_model()
    done = add_lora(model, PeftConfig(lora_rank=4, lora_alpha=8.0, target_modules=TARGETS), cfg, rules(cfg), seed=0)
    high = [name for name in done if name.startswith("high_noise.")]
    assert len(high) > 0 and sorted(done) == sorted([*high, *(n.replace("high_", "low_", 1) for n in high)])
    adapters = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora." in name for name in adapters)
    a = "layers.0.self_attention.linear_qkv.lora.A.0"
    assert not torch.equal(adapters[f"high_noise.{a}"], adapters[f"low_noise.{a}"])  # drawn by their own names
    with torch.no_grad():  # B != 0, so that A gets gradients too
        for name, param in adapters.items():
            if ".lora.B." in name:
                param.normal_(0, 0.1)
    flow = build_pipeline("flow", c_noise_scale=1000.0)
    samples = parity_samples(cfg, SHAPES[:2])
    pack, _, x_in, c_noise = packed(samples, samples, LEVELS[[0, 2]], flow)
    pack = dataclasses.replace(pack, expert_ids=torch.tensor([0, 0]))  # both high noise
    model(x_in, c_noise, pack).square().mean().backward()
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    for name, param in adapters.items():
        assert param.grad is not None and bool(param.grad.any()) == name.startswith("high_noise."), name


BOTH = ["flow.shift=5", "optimizer.lr=3e-2"]  # shift 5: about a third of the samples are high-noise


@pytest.fixture(scope="module")
def both_run(imported, tmp_path_factory):  # noqa: F811
    """(metrics, checkpoint root) of a one-process LoRA run of both experts."""
    return lora_run(tmp_path_factory.mktemp("both_lora"), imported, "both", BOTH)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_both_experts_lora_trains_and_exports_into_both_transformers(both_run, tmp_path):
    metrics, ckpt = both_run
    losses = [m["loss"] for m in metrics]
    assert len(losses) == ITERS and falls(losses), losses
    assert all(m["samples_high_noise"] + m["samples_low_noise"] > 0 for m in metrics)
    assert_measured_matches_formula(next(ckpt.parent.glob("**/memory_per_rank.json")).parent)
    lora = tmp_path / "lora"
    export(["export-lora", "--checkpoint", ckpt, "--output", lora])
    export(["export-lora", "--checkpoint", ckpt, "--output", lora, "--overwrite"])  # its subfolders may go
    export(["export", "--merge-lora", "--checkpoint", ckpt, "--output", tmp_path / "merged"])
    pipe = base_pipeline()
    pipe.load_lora_weights(str(lora / "transformer"))
    pipe.load_lora_weights(str(lora / "transformer_2"), load_into_transformer_2=True)
    merged = diffusers.WanPipeline.from_pretrained(tmp_path / "merged", torch_dtype=torch.float32, **ABSENT)
    assert merged.config.boundary_ratio == BOUNDARY
    assert_loaded_equals_merged(pipe, merged, {"transformer": True, "transformer_2": True})


# TP=2 + SP; DP=2 with the distributed optimizer and overlapped reduction (which waits for every
# adapter's gradient: the expert without samples on a rank gives zeros).
LAYOUTS = {
    "tp2_sp": ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
    "dp2_distopt": ["ddp.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=true"],
}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_both_experts_lora_layout_trains_like_one_process(imported, both_run, tmp_path, layout):  # noqa: F811
    run, ckpt = lora_run(tmp_path, imported, "both", [*BOTH, *LAYOUTS[layout]], nproc=2)
    for ours, reference in zip(run, both_run[0], strict=True):
        for key in ("loss", "loss_high_noise", "loss_low_noise", "grad_norm"):
            if reference[key] is not None:
                assert abs(ours[key] - reference[key]) <= 1e-4 * abs(reference[key]), (key, ours, reference)
    # The TP-split adapters of both experts, saved at their global offsets, are the one-process run's.
    (_, weights), (_, expected) = read_full_weights(ckpt), read_full_weights(both_run[1])
    adapters = [name for name in expected if ".lora." in name]
    assert {n.split(".")[0] for n in adapters} == {"high_noise", "low_noise"} and weights.keys() == expected.keys()
    for name in adapters:
        torch.testing.assert_close(weights[name], expected[name], rtol=0, atol=ADAPTER_ATOL, msg=name)
    assert all(torch.equal(weights[name], expected[name]) for name in expected if name not in adapters)  # frozen
