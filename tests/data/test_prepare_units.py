"""Preparation building blocks: captions, resolution buckets, atomic shards, encoders, CLI arguments."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dfm.data.encoders import T5TextEncoder, VideoVAE, build_tiny_random_encoders, is_tiny_random
from dfm.data.prepare.buckets import RESOLUTION_PRESETS, ResolutionPolicy, budget_bucket, resize_center_crop
from dfm.data.prepare.captions import CaptionLookup
from dfm.data.prepare.media import read_video, usable_frame_count
from dfm.data.prepare.pipeline import CaptionEncodings, Encoders
from dfm.data.prepare.shards import AtomicShardWriter, encode_sample_parts

RECIPES = Path(__file__).resolve().parents[2] / "examples" / "megatron" / "recipes" / "dit"


@settings(max_examples=200, deadline=None)
@given(
    h=st.integers(16, 4000),
    w=st.integers(16, 4000),
    preset=st.sampled_from(sorted(RESOLUTION_PRESETS)),
    multiple=st.sampled_from([8, 16, 32]),
)
def test_budget_bucket_keeps_multiples_budget_and_aspect(h, w, preset, multiple):
    budget = RESOLUTION_PRESETS[preset]
    bh, bw = budget_bucket(h, w, budget, multiple)
    assert bh % multiple == 0 and bw % multiple == 0 and bh * bw <= budget
    if min(bh, bw) > 4 * multiple:  # rounding to multiples bends the ratio by at most one block per side
        assert abs((bh / bw) / (h / w) - 1) < 2 * multiple / min(bh, bw) + 0.01


def test_fixed_size_must_be_a_multiple():
    with pytest.raises(ValueError, match="height=100"):
        ResolutionPolicy.from_args(16, height=100, width=128)


def test_resize_center_crop_shape_and_range():
    frames = torch.randint(0, 256, (3, 50, 70, 3), dtype=torch.uint8).numpy()
    video = resize_center_crop(frames, 32, 48)
    assert video.shape == (3, 3, 32, 48) and video.min() >= -1 and video.max() <= 1


def test_usable_frame_count_matches_wan_compression():
    assert [usable_frame_count(n, 17, 4) for n in (1, 4, 5, 12, 40)] == [1, 1, 5, 9, 17]


def test_read_video_takes_every_stride_th_frame_and_names_an_undecodable_file(tmp_path):
    from imageio_ffmpeg import get_ffmpeg_exe

    levels = np.arange(9, dtype=np.uint8) * 25  # frame i is grey level 25 i
    grey = np.repeat(levels, 12 * 20).reshape(9, 12, 20)
    path = tmp_path / "steps.mp4"
    command = [get_ffmpeg_exe(), "-v", "error", "-f", "rawvideo", "-pix_fmt", "gray", "-s", "20x12", "-r", "10"]
    subprocess.run([*command, "-i", "-", "-c:v", "libx264", "-qp", "0", str(path)], input=grey.tobytes(), check=True)
    item = read_video(path, num_frames=4, frame_stride=2, temporal_compression=1)
    assert item.frames.shape == (4, 12, 20, 3) and item.frames.dtype == np.uint8
    assert np.abs(item.frames.astype(int) - levels[[0, 2, 4, 6], None, None, None]).max() <= 1  # lossless in YUV
    assert (item.fps, item.source_frames) == (5.0, -1)
    assert read_video(path, num_frames=8, frame_stride=1, temporal_compression=4).frames.shape[0] == 5  # 1 + 4k
    (tmp_path / "broken.mp4").write_bytes(b"not a video" * 20)
    with pytest.raises(ValueError, match="broken.mp4: no decodable frames .*Invalid data"):
        read_video(tmp_path / "broken.mp4", 4, 1, 1)


def test_caption_formats_and_fallback(tmp_path):
    for name in ("a_b.png", "side.jpg", "lines.mp4", "meta.webp", "sub/deep.png"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    (tmp_path / "side.json").write_text(json.dumps({"caption": "from sidecar"}))
    (tmp_path / "c.jsonl").write_text(
        json.dumps({"path": "sub/deep.png", "caption": "from jsonl"})
        + "\n"
        + json.dumps({"video": "lines.mp4", "caption": "video line"})
        + "\n"
    )
    (tmp_path / "meta.json").write_text(json.dumps({"meta.webp": "from meta"}))
    lookup = CaptionLookup(tmp_path)
    got = {
        n: (c.text, c.source)
        for n in ("a_b.png", "side.jpg", "lines.mp4", "meta.webp", "sub/deep.png")
        for c in [lookup.caption(tmp_path / n)]
    }
    assert got == {
        "a_b.png": ("a b", "filename"),
        "side.jpg": ("from sidecar", "sidecar"),
        "lines.mp4": ("video line", "jsonl"),
        "meta.webp": ("from meta", "meta_json"),
        "sub/deep.png": ("from jsonl", "jsonl"),
    }
    only_meta = CaptionLookup(tmp_path, "meta_json")
    assert only_meta.caption(tmp_path / "side.jpg").source == "filename"


def test_bad_jsonl_line_is_named(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"file": "x.png", "caption": "ok"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        CaptionLookup(tmp_path)


def test_captions_come_from_caption_internvl_or_usr_first_present(tmp_path):
    for name in ("a.png", "b.png", "c.png", "m1.png", "m2.png"):
        (tmp_path / name).touch()
    lines = [
        {"file": "a.png", "internvl": "from internvl", "usr": "not this"},
        {"file": "b.png", "usr": "from usr"},
        {"file": "c.png", "caption": "from caption", "internvl": "not this"},
    ]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    meta = [{"file_name": "m1.png", "internvl": "meta internvl"}, {"file_name": "m2.png", "usr": "meta usr"}]
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    lookup = CaptionLookup(tmp_path)
    got = {n: lookup.caption(tmp_path / n).text for n in ("a.png", "b.png", "c.png", "m1.png", "m2.png")}
    assert got == {
        "a.png": "from internvl",
        "b.png": "from usr",
        "c.png": "from caption",
        "m1.png": "meta internvl",
        "m2.png": "meta usr",
    }
    (tmp_path / "meta.json").write_text(json.dumps([{"file_name": "m1.png", "text": "?"}]))
    with pytest.raises(ValueError, match=r"meta\.json: entry .* has no caption \(expected one of .*internvl.*usr"):
        CaptionLookup(tmp_path)


def test_a_caption_file_that_is_not_utf8_is_named(tmp_path):
    (tmp_path / "latin1.jsonl").write_bytes('{"file": "x.png", "caption": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.jsonl: not UTF-8 text"):
        CaptionLookup(tmp_path)


def test_a_folder_without_media_fails_naming_it_and_the_extensions(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "notes.txt").write_text("no media here")
    code = load_script("prepare_energon_dataset").main(
        ["--input_dir", str(tmp_path / "in"), "--output_dir", str(tmp_path / "out"), "--tiny_random_encoders"]
    )
    err = capsys.readouterr().err
    assert code == 1 and f"input_dir {tmp_path / 'in'} holds no media files" in err
    assert all(ext in err for ext in (".jpg", ".png", ".webp", ".mp4", ".mov")), err


def test_atomic_shard_writer_leaves_no_partial_shard_on_error(tmp_path):
    parts = encode_sample_parts("k0", torch.zeros(4, 1, 2, 2), torch.zeros(3, 8), {"caption": "c"})
    with pytest.raises(RuntimeError):
        with AtomicShardWriter(tmp_path, "rank000", maxcount=2) as writer:
            for i in range(3):
                writer.write({**parts, "__key__": f"k{i}"})
            raise RuntimeError("crash while the second shard is open")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank000-000000.tar"]


@pytest.fixture(scope="module")
def tiny_encoders(tmp_path_factory):
    return build_tiny_random_encoders(tmp_path_factory.mktemp("encoders"))


def test_tiny_t5_encodes_unpadded_truncated_embeddings(tiny_encoders):
    encoder = T5TextEncoder.from_pretrained_or_cache(tiny_encoders.t5_dir, max_length=12)
    short, long = encoder.encode(["cat", "a caption much longer than twelve bytes"])
    assert short.shape == (4, encoder.embed_dim) and long.shape == (12, encoder.embed_dim)  # ByT5: bytes + </s>
    assert is_tiny_random(tiny_encoders.t5_dir)


def test_repeated_captions_are_encoded_once_while_they_fit(tiny_encoders):
    encoder = T5TextEncoder.from_pretrained_or_cache(tiny_encoders.t5_dir, max_length=12)
    encode, encoded = encoder.encode, []

    def counting_encode(texts: list[str]) -> list[torch.Tensor]:
        encoded.extend(texts)
        return encode(texts)

    encoder.encode = counting_encode
    two_captions = 2 * encode(["cat"])[0].nbytes  # every 3-letter caption is 4 ByT5 tokens
    encodings = CaptionEncodings(Encoders(text=encoder, vae=None, tiny_random=True), max_bytes=two_captions)
    texts = {caption: encodings(caption)[0] for caption in ("cat", "dog", "cat", "eel", "dog")}
    assert encoded == ["cat", "dog", "eel", "dog"]  # "cat" reused; "eel" pushed out "dog", the least recent
    assert all(torch.equal(text, encode([caption])[0]) for caption, text in texts.items())
    assert encodings("eel")[1] is None and encodings.nbytes == two_captions  # no pooled encoder


@pytest.mark.parametrize("which, temporal", [("wan_vae_dir", 4), ("kl_vae_dir", 1)])
def test_tiny_vae_round_trip_shapes(tiny_encoders, which, temporal):
    vae = VideoVAE.from_pretrained_or_cache(getattr(tiny_encoders, which))
    assert vae.spatial_compression == 8 and vae.temporal_compression == temporal
    video = torch.rand(1, 3, 5, 32, 48) * 2 - 1
    latents = vae.encode(video)
    assert latents.shape == (1, vae.latent_channels, vae.latent_frames(5), 4, 6)
    assert vae.decode(latents).shape == video.shape
    assert torch.equal(vae.encode(video), latents)  # posterior mean: deterministic


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prepare_cli_arguments():
    script = load_script("prepare_energon_dataset")
    args = script.build_parser().parse_args(
        [
            "--input_dir",
            "in",
            "--output_dir",
            "out",
            "--caption_format",
            "jsonl",
            "--resolution_preset",
            "512p",
            "--t5_cache_dir",
            "t5c",
            "--vae_cache_dir",
            "vaec",
            "--num_frames",
            "33",
            "--tiny_random_encoders",
            "--shard_maxcount",
            "50",
        ]
    )
    settings_ = script.settings_from_args(args)
    assert (settings_.caption_format, settings_.resolution_preset, settings_.num_frames) == ("jsonl", "512p", 33)
    assert settings_.tiny_random_encoders and settings_.shard_maxcount == 50 and settings_.t5_cache_dir == "t5c"
    with pytest.raises(SystemExit):
        script.build_parser().parse_args(
            ["--input_dir", "i", "--output_dir", "o", "--resolution_preset", "256p", "--max_pixels", "10"]
        )


def test_butterfly_cli_arguments():
    script = load_script("prepare_energon_dataset_butterfly")
    args = script.build_parser().parse_args(["--output_dir", "out", "--max_samples", "10", "--tiny_random_encoders"])
    assert args.dataset == "huggan/smithsonian_butterflies_subset" and args.max_samples == 10


def test_prepare_cli_runs_end_to_end(tmp_path, example_dataset, capsys):
    script = load_script("prepare_energon_dataset")
    argv = [
        "--input_dir",
        str(example_dataset.raw_dir),
        "--output_dir",
        str(tmp_path / "out"),
        "--caption_format",
        "sidecar",
        "--height",
        "32",
        "--width",
        "48",
        "--num_frames",
        "5",
        "--tiny_random_encoders",
        "--vae_kind",
        "kl",
        "--max_text_len",
        "32",
    ]
    code = script.main(argv)
    # 1 corrupt file of 8 is more than the default --max_skip_fraction 0.05: the run fails after its report
    assert code == 1 and "broken_photo.jpg" in capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "prepare_report.rank0.json").read_text())
    assert report["written"] == len(example_dataset.captions) and len(report["skipped"]) == 1
    assert script.main([*argv, "--resume", "--max_skip_fraction", "0.2"]) == 0  # accepted, nothing re-encoded


def test_shard_members_carry_one_header_each(tmp_path):
    """Whole-second mtimes: a fractional one makes tarfile write a pax header per member, which the
    loader then reads and parses on every sample."""
    parts = encode_sample_parts("k0", torch.zeros(4, 1, 2, 2), torch.zeros(3, 8), {"caption": "c"})
    with AtomicShardWriter(tmp_path, "rank000", maxcount=4) as writer:
        writer.write({**parts, "__key__": "k0"})
    with tarfile.open(tmp_path / "rank000-000000.tar") as tar:
        members = tar.getmembers()
    assert len(members) == 3 and all(not m.pax_headers and isinstance(m.mtime, int) for m in members)
    raw = (tmp_path / "rank000-000000.tar").read_bytes()
    assert b"PaxHeader" not in raw
