"""Energon datasets of mock samples (random latents and text) in the shard format: for tests and
benchmarks of the loader without running any encoder."""

from __future__ import annotations

from pathlib import Path

from dfm.data.mock import MockDataSettings, mock_latent_and_text
from dfm.data.prepare.energon_prepare import run_energon_prepare
from dfm.data.prepare.shards import AtomicShardWriter, encode_sample_parts


def write_synthetic_dataset(
    out_dir: str | Path,
    num_samples: int,
    settings: MockDataSettings,
    shard_maxcount: int = 16,
    run_energon: bool = True,
    key_prefix: str = "",
    split_ratio: str = "1,0,0",
) -> Path:
    """Shards of mock samples 0..num_samples-1; metadata caption is ``"mock sample <i>"``."""
    out_dir = Path(out_dir)
    with AtomicShardWriter(out_dir, "synthetic", shard_maxcount) as writer:
        for index in range(num_samples):
            latent, text = mock_latent_and_text(settings, index)
            metadata = {"caption": f"mock sample {index}", "mock_index": index, "source_path": f"mock/{index}"}
            writer.write(encode_sample_parts(f"{key_prefix}{index:08d}", latent, text, metadata))
    if run_energon:
        run_energon_prepare(out_dir, split_ratio=split_ratio)
    return out_dir
