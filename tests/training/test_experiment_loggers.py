"""TensorBoard and Weights & Biases (offline) receive the same numbers as metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from entry import read_metrics, run_entry


def tensorboard_scalars(folder: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


WANDB_HEADER, BLOCK, RECORD_HEADER = 7, 32768, 7  # wandb's record log: leveldb-style 32 KiB blocks


def wandb_records(path: Path) -> list[bytes]:
    """Payloads of a .wandb file (magic + version, then blocks of [crc u32, length u16, type u8] records)."""
    data, records, pending, offset = path.read_bytes(), [], b"", WANDB_HEADER
    while offset + RECORD_HEADER <= len(data):
        room = BLOCK - offset % BLOCK
        if room < RECORD_HEADER:  # block trailer padding
            offset += room
            continue
        length, kind = int.from_bytes(data[offset + 4 : offset + 6], "little"), data[offset + 6]
        if kind == 0 and length == 0:
            break
        pending += data[offset + RECORD_HEADER : offset + RECORD_HEADER + length]
        offset += RECORD_HEADER + length
        if kind in (1, 4):  # FULL or LAST
            records.append(pending)
            pending = b""
    return records


def wandb_offline_history(log_dir: Path, key: str) -> dict[int, float]:
    """``key`` per step, read back from the offline run's .wandb record file."""
    from wandb.proto import wandb_internal_pb2

    (run_file,) = log_dir.glob("wandb/offline-run-*/run-*.wandb")
    history = {}
    for payload in wandb_records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            if key in items:
                history[int(items["_step"])] = items[key]
    return history


@pytest.mark.slow
def test_tensorboard_and_wandb_offline_match_metrics(tmp_path):
    log_dir, tb_dir = tmp_path / "logs", tmp_path / "tb"
    result = run_entry(
        1,
        [
            "train.train_iters=3",
            f"logger.log_dir={log_dir}",
            f"logger.tensorboard_dir={tb_dir}",
            "logger.wandb_project=dfm-test",
            "logger.wandb_exp_name=offline",
        ],
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    expected = {r["iteration"]: r["loss"] for r in read_metrics(log_dir)}
    assert tensorboard_scalars(tb_dir, "train/loss") == pytest.approx(expected, rel=1e-6)  # TB stores float32
    assert wandb_offline_history(log_dir, "train/loss") == pytest.approx(expected, rel=1e-12)
