"""LoRA on Wan 2.2 A14B's experts through the real entry point (one process, tiny model, mock data),
from the import of a tiny two-transformer pipeline folder:

* one expert (the low-noise one): ``export-lora`` writes a file that ``WanPipeline.load_lora_weights(...,
  load_into_transformer_2=True)`` loads into transformer_2 (transformer untouched), and that pipeline
  gives the outputs of ``export --merge-lora`` (with the high-noise import) loaded as a plain pipeline.
"""

import contextlib
import io

import diffusers
import pytest
import torch

from dfm.convert.wan import diffusers_sample_output, parity_samples, parity_timesteps
from tests.wan._tiny import TEXT_LEN, tiny_model_config
from tests.wan.test_wan22_experts import experts, run_cli
from tests.wan.test_wan22_finetune_entry import ABSENT, BOUNDARY, finetune, imported  # noqa: F401

TOLERANCE = 1e-5
ITERS = 4
# Fused (q/k/v: q and v only), row-parallel, cross-attention k of k/v and MLP targets.
LORA = [
    "peft.lora_rank=4",
    "peft.lora_alpha=8",
    "peft.target_modules=[to_q,to_v,to_out.0,attn2.to_k,ffn.net.0.proj]",
    f"train.train_iters={ITERS}",
    "optimizer.lr=1e-2",
]


def lora_run(tmp_path, pretrained, expert: str) -> tuple:
    """(metrics, checkpoint root) of a one-process LoRA run of ``expert`` from ``pretrained``."""
    run = tmp_path / expert
    save = [f"checkpoint.save={run / 'checkpoints'}", f"checkpoint.save_interval={ITERS}"]
    return finetune(1, run, pretrained, expert, [*LORA, *save]), run / "checkpoints"


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
