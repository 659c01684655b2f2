"""A ``dataset.seq_length`` shorter than most samples stops the run naming it (it dropped most samples and
exited 0); a few longer samples are still skipped with a warning (tests/data/test_packing.py)."""

from __future__ import annotations

import pytest
from synthetic_data import small_settings

from dfm.data.energon.data_module import build_train_loader
from dfm.data.energon.task_encoder import PackingSettings, SeqLengthError
from tests.training.entry import run_entry


def test_the_loader_names_a_seq_length_shorter_than_most_samples(synthetic_dataset):
    settings = small_settings(synthetic_dataset, packing=PackingSettings(seq_length=16))
    loader = build_train_loader(settings, dp_rank=0, dp_size=1)
    with pytest.raises(SeqLengthError, match=r"dataset.seq_length=16 is shorter than most samples: \d+ of the first"):
        for _ in range(50):
            next(loader)


@pytest.mark.slow  # starts training through the entry point on real shards (README: the quick tier leaves those out)
def test_training_stops_naming_dataset_seq_length(synthetic_dataset, tmp_path):
    overrides = [f"dataset.path={synthetic_dataset}", "dataset.num_workers=0", "dataset.seq_length=16"]
    overrides += ["model.text_embed_dim=16", "train.train_iters=3", f"logger.log_dir={tmp_path / 'logs'}"]
    result = run_entry(1, overrides, mock=False, timeout=300)
    assert result.returncode != 0
    assert "dataset.seq_length=16 is shorter than most samples" in result.stderr, result.stderr[-3000:]
