"""HunyuanVideo 1.5 through the real entry points: a tiny diffusers pipeline folder is imported
(convert_hunyuan.py's ``main`` with ``--verify``: dfm vs diffusers on the mixed t2v / i2v pack) and
exported back bit for bit; the import is fine-tuned 3 iterations at TP=2 + SP from
``checkpoint.pretrained`` (pretrain entry point) on HunyuanVideo 1.5 shards (ByT5 text, first-frame
latent, SigLIP embedding per clip; ``dataset.i2v_prob=0.5``), exported, and the export is diffusers'
model (``from_pretrained``) holding exactly the weights the ranks trained."""

from __future__ import annotations

import json
from pathlib import Path

import diffusers
import pytest
import torch
import webdataset as wds

from dfm.convert.cli import main
from dfm.convert.hunyuan import HUNYUAN, hunyuan_rules
from tests._parity import assert_bit_equal, assert_export_is_finetuned, verified_diff
from tests.hunyuan._tiny import CAPTIONS, dfm_config_and_weights, prepare_with_hunyuan_encoders, tiny_diffusers_hunyuan
from tests.parallel.equivalence import WEIGHTS_ENTRY
from tests.training.entry import read_metrics, run_entry

HUNYUAN_TINY = Path(__file__).resolve().parents[2] / "examples/megatron/recipes/hunyuan/conf/hunyuan_tiny.yaml"


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def load_export(folder: Path, reference) -> dict:
    """The exported folder through diffusers' from_pretrained; its config must be ``reference``'s."""
    loaded = diffusers.HunyuanVideo15Transformer3DModel.from_pretrained(folder)
    assert all(_plain(loaded.config[k]) == _plain(v) for k, v in reference.config.items() if not k.startswith("_"))
    return loaded.state_dict()


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return prepare_with_hunyuan_encoders(tmp_path_factory.mktemp("hunyuan_data"))


@torch.no_grad()
def test_shards_hold_what_the_diffusers_pipelines_encode(shards):
    """Per clip: Qwen2.5-VL and ByT5 text (HunyuanVideo15ImageToVideoPipeline.encode_prompt, real tokens
    only), the first frame's latent (prepare_cond_latents_and_mask's frame 0) and SigLIP embedding
    (encode_image), and the video latent whose first frame is that latent (a causal VAE)."""
    from dfm.data.encoders.hunyuan import HunyuanEncoders, first_frame_image

    tiny = HunyuanEncoders.from_folder(shards / ".tiny_random_encoders" / "rank0")
    pipeline = diffusers.HunyuanVideo15ImageToVideoPipeline(
        tiny.qwen,
        tiny.qwen_tokenizer,
        None,
        tiny.vae,
        None,
        tiny.byt5,
        tiny.byt5_tokenizer,
        None,
        tiny.siglip,
        tiny.siglip_processor,
    )
    samples = {s["json"]["source_path"]: s for s in wds.WebDataset(sorted(map(str, shards.glob("*.tar")))).decode()}
    assert sorted(samples) == ["bars.mp4", "dots.mp4"]
    for name, sample in samples.items():
        qwen, qwen_mask, byt5, byt5_mask = pipeline.encode_prompt(CAPTIONS[name[:-4]], torch.device("cpu"))
        for stored, (embeds, mask) in (
            (torch.from_numpy(sample["pickle"]), (qwen, qwen_mask)),
            (sample["byt5.pth"], (byt5, byt5_mask)),
        ):
            expected = embeds[0][mask[0].bool()]
            assert stored.shape == expected.shape and torch.allclose(stored, expected, rtol=0, atol=1e-5), name
        assert (sample["byt5.pth"].shape[0] > 0) == ('"' in CAPTIONS[name[:-4]]), name
        image = first_frame_image(torch.zeros(3, 1, 32, 48))  # only its size matters below
        assert sample["image.pth"].shape == pipeline.encode_image(image, 1, torch.device("cpu"), torch.float32)[0].shape
        latent = sample["pth"]
        assert latent.shape == (4, 2, 4, 6) and sample["first_frame.pth"].shape == (4, 1, 4, 6), name
        assert float((sample["first_frame.pth"][:, 0] - latent[:, 0]).abs().max()) <= 1e-4, name


@pytest.mark.slow
def test_import_verify_finetune_at_tp2_export_loads_in_diffusers(shards, tmp_path, capsys):
    pipeline, reference = tmp_path / "HunyuanVideo-1.5-tiny", tiny_diffusers_hunyuan()
    reference.save_pretrained(pipeline / "transformer")
    (pipeline / "model_index.json").write_text(json.dumps({"_class_name": "HunyuanVideo15Pipeline"}))
    cfg, start = dfm_config_and_weights(reference)
    imported, trained, dump = tmp_path / "imported", tmp_path / "trained", tmp_path / "weights.pt"
    assert main(HUNYUAN, ["import", "--diffusers", str(pipeline), "--output", str(imported), "--verify"]) == 0
    assert verified_diff(capsys.readouterr().out) <= 1e-5

    # Import then export, untouched: every tensor back bit for bit.
    assert main(HUNYUAN, ["export", "--checkpoint", str(imported), "--output", str(tmp_path / "same")]) == 0
    same, original = load_export(tmp_path / "same", reference), reference.state_dict()
    assert_bit_equal(same, original)

    args = ["train.train_iters=3", "optimizer.lr=1e-4", f"logger.log_dir={tmp_path / 'log'}"]
    args += [f"dataset.path={shards}", "dataset.num_workers=0", "dataset.i2v_prob=0.5"]
    args += ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true", f"checkpoint.pretrained={imported}"]
    args += [f"checkpoint.save={trained}", "checkpoint.save_interval=3"]
    result = run_entry(
        2, args, entry=WEIGHTS_ENTRY, env={"DFM_TEST_FULL_WEIGHTS": str(dump)}, config=HUNYUAN_TINY, mock=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [m["iteration"] for m in read_metrics(tmp_path / "log")] == [1, 2, 3]
    assert main(HUNYUAN, ["export", "--checkpoint", str(trained), "--output", str(tmp_path / "export")]) == 0
    exported = load_export(tmp_path / "export", reference)

    assert_export_is_finetuned(exported, dump, start, hunyuan_rules(cfg.model))
