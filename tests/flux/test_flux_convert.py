"""FLUX.1 through the real entry points: a tiny diffusers FLUX is imported (convert_flux.py's ``main``,
with ``--verify``); captioned images are prepared with the tiny FLUX encoders (prepare_energon_dataset.py
``--encoders flux``, the real ``energon prepare``), and the shards hold what FluxPipeline encodes; the
import is fine-tuned 3 iterations at TP=2 + SP on those shards (pretrain_dit_model.py,
``checkpoint.pretrained``), exported and loaded by diffusers; inference_dit_model.py writes a png from it."""

from __future__ import annotations

import json
from pathlib import Path

import diffusers
import imageio.v3 as iio
import numpy as np
import pytest
import torch
import webdataset as wds

from dfm.convert.cli import main
from dfm.convert.flux import FLUX, flux_rules
from dfm.data.encoders import CLIPPooledEncoder, T5TextEncoder, VideoVAE
from dfm.data.prepare.buckets import resize_center_crop
from dfm.inference.generate import main as generate_main
from tests._parity import assert_bit_equal, assert_export_is_finetuned, verified_diff
from tests.flux._tiny import TINY_IMAGES, dfm_config_and_weights, prepare_with_flux_encoders, tiny_diffusers_flux
from tests.parallel.equivalence import WEIGHTS_ENTRY
from tests.training.entry import read_metrics, run_entry

FLUX_TINY = (
    Path(__file__).resolve().parents[2] / "examples" / "megatron" / "recipes" / "flux" / "conf" / "flux_tiny.yaml"
)
# The model of flux_tiny.yaml, as diffusers writes it (the tiny FLUX encoders' widths: T5 32, CLIP 16).
TINY_AS_FLUX_TINY_YAML = dict(
    num_attention_heads=4, attention_head_dim=16, joint_attention_dim=32, pooled_projection_dim=16
)
TEXT_LEN = 16


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return prepare_with_flux_encoders(tmp_path_factory.mktemp("flux_data"), TEXT_LEN)


def shard_samples(shards: Path) -> dict[str, dict]:
    """{source file name: its decoded shard parts}."""
    samples = wds.WebDataset([str(p) for p in sorted(shards.glob("*.tar"))], shardshuffle=False).decode()
    return {sample["json"]["source_path"]: sample for sample in samples}


def test_shards_hold_what_fluxpipeline_encodes(shards):
    """T5 embeddings, the pooled CLIP vector (FluxPipeline.encode_prompt) and the VAE latent
    ((z - shift_factor) * scaling_factor, which FluxPipeline inverts) of each image and caption."""
    tiny = shards / ".tiny_random_encoders" / "rank0"
    t5 = T5TextEncoder.from_pretrained_or_cache(tiny / "t5", max_length=TEXT_LEN)
    clip = CLIPPooledEncoder.from_pretrained(tiny / "clip")
    vae = VideoVAE.from_pretrained_or_cache(tiny / "vae_flux").model
    pipeline = diffusers.FluxPipeline(None, vae, clip.model, clip.tokenizer, t5.model, t5.tokenizer, None)
    samples = shard_samples(shards)
    assert sorted(samples) == sorted(f"{name}.png" for name, _, _ in TINY_IMAGES)
    for name, sample in samples.items():
        text, pooled, _ = pipeline.encode_prompt(sample["json"]["caption"], None, max_sequence_length=TEXT_LEN)
        assert torch.equal(torch.from_numpy(sample["pickle"]), text[0]), name
        assert torch.equal(sample["pooled.pth"], pooled[0]), name
        bucket = sample["json"]["bucket_height"], sample["json"]["bucket_width"]
        pixels = resize_center_crop(iio.imread(shards.parent / "images" / name)[None], *bucket)[:, 0]  # [3, H, W]
        z = vae.encode(pixels[None]).latent_dist.mode()
        latent = (z - vae.config.shift_factor) * vae.config.scaling_factor
        assert float((sample["pth"][:, 0] - latent[0]).abs().max()) <= 1e-5, name


def test_flux_run_without_pooled_vectors_names_the_part(tmp_path):
    """Shards without '.pooled.pth' (DFM's, or prepared for another model) stop a FLUX run at the first sample."""
    from dfm.data.energon.cooker import BadSampleError
    from dfm.data.energon.data_module import build_train_loader
    from tests.data.synthetic_data import small_settings
    from tests.data.test_cooker_and_blend import write_dfm_style_shard

    write_dfm_style_shard(tmp_path / "dfm")
    settings = small_settings(tmp_path / "dfm")
    assert next(build_train_loader(settings, 0, 1)).pooled_text is None  # other models: ignored
    settings.packing.pooled_text_dim = 16
    part = r"no pooled text vector '\.pooled\.pth' \(model\.pooled_text_dim=16"
    with pytest.raises(BadSampleError, match=rf"shard .*/dfm/dfm-000000\.tar, key dfm\d+: {part}"):
        next(build_train_loader(settings, 0, 1))


def test_import_from_a_pipeline_folder_verifies_and_exports_back(tmp_path, capsys):
    """A FLUX.1 pipeline layout (model_index.json, transformer/): what docs/flux.md's import reads."""
    pipeline, reference = tmp_path / "FLUX.1-tiny", tiny_diffusers_flux()
    reference.save_pretrained(pipeline / "transformer")
    (pipeline / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    imported, export = tmp_path / "imported", tmp_path / "export"
    assert main(FLUX, ["import", "--diffusers", str(pipeline), "--output", str(imported), "--verify"]) == 0
    assert verified_diff(capsys.readouterr().out) <= 1e-5
    assert main(FLUX, ["export", "--checkpoint", str(imported), "--output", str(export)]) == 0
    back = diffusers.FluxTransformer2DModel.from_pretrained(export).state_dict()
    assert all(torch.equal(back[name], tensor) for name, tensor in reference.state_dict().items())


@pytest.mark.slow
def test_import_finetune_on_prepared_shards_at_tp2_export_loads_in_diffusers(shards, tmp_path, capsys):
    source, reference = tmp_path / "diffusers", tiny_diffusers_flux(**TINY_AS_FLUX_TINY_YAML)
    reference.save_pretrained(source)
    original = reference.state_dict()
    cfg, start = dfm_config_and_weights(reference)
    imported = tmp_path / "imported"
    assert main(FLUX, ["import", "--diffusers", str(source), "--output", str(imported), "--verify"]) == 0
    assert verified_diff(capsys.readouterr().out) <= 1e-5

    # Import then export, untouched: every tensor back bit for bit.
    assert main(FLUX, ["export", "--checkpoint", str(imported), "--output", str(tmp_path / "same")]) == 0
    same = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path / "same").state_dict()
    assert_bit_equal(same, original)

    trained, dump = tmp_path / "trained", tmp_path / "weights.pt"
    args = ["train.train_iters=3", "optimizer.lr=1e-4", f"logger.log_dir={tmp_path / 'log'}"]
    args += [f"dataset.path={shards}", "dataset.num_workers=0"]
    args += ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true", f"checkpoint.pretrained={imported}"]
    args += [f"checkpoint.save={trained}", "checkpoint.save_interval=3"]
    env = {"DFM_TEST_FULL_WEIGHTS": str(dump)}
    result = run_entry(2, args, entry=WEIGHTS_ENTRY, env=env, config=FLUX_TINY, mock=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [m["iteration"] for m in read_metrics(tmp_path / "log")] == [1, 2, 3]
    assert main(FLUX, ["export", "--checkpoint", str(trained), "--output", str(tmp_path / "export")]) == 0
    exported = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path / "export").state_dict()

    assert_export_is_finetuned(exported, dump, start, flux_rules(cfg.model))

    # Generation from the fine-tuned checkpoint: tiny FLUX encoders (T5, CLIP, FLUX's VAE) -> a png.
    png = tmp_path / "flux.png"
    generate_args = ["--checkpoint_path", str(trained), "--tiny_random_encoders", "--prompt", "a red stripe"]
    generate_args += ["--height", "32", "--width", "48", "--num_steps", "2", "--guidance_scale", "3.5"]
    assert generate_main([*generate_args, "--video_save_path", str(png)]) == png
    image = iio.imread(png)
    assert image.shape == (32, 48, 3) and np.ptp(image) > 0
