"""bf16 with fp32 master weights on CPU, through the real entry point."""

from __future__ import annotations

import pytest
from entry import read_metrics, run_entry


def losses(tmp_path, precision: str) -> list[float]:
    log_dir = tmp_path / precision
    result = run_entry(
        1, ["train.train_iters=6", f"mixed_precision.precision={precision}", f"logger.log_dir={log_dir}"]
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [r["loss"] for r in read_metrics(log_dir)]


@pytest.mark.slow
def test_bf16_tracks_fp32(tmp_path):
    fp32, bf16 = losses(tmp_path, "fp32"), losses(tmp_path, "bf16")
    # Step 1 is exact: the zero-initialised final layer outputs 0 in any precision.
    assert bf16[0] == fp32[0]
    # Later steps differ by bf16 rounding only; fp32 master weights keep them within 2%.
    assert bf16[1:] != fp32[1:]
    assert bf16 == pytest.approx(fp32, rel=2e-2)


@pytest.mark.slow
def test_fp8_products_track_bf16(tmp_path):
    """``mixed_precision.fp8=hybrid`` on bf16: the start-up log names how many linears run their products
    in FP8 (dit_tiny: 7 a layer, the self- and cross-attention's and the MLP's; adaLN's rows keep bf16); the losses stay within 1% of bf16's."""
    runs = {}
    for name, extra in (("bf16", []), ("fp8", ["mixed_precision.fp8=hybrid"])):
        log_dir = tmp_path / name
        result = run_entry(
            1, ["train.train_iters=20", "mixed_precision.precision=bf16", f"logger.log_dir={log_dir}", *extra]
        )
        assert result.returncode == 0, result.stderr[-4000:]
        runs[name] = [r["loss"] for r in read_metrics(log_dir)], result.stdout + result.stderr
    (bf16, _), (fp8, log) = runs["bf16"], runs["fp8"]
    assert "mixed_precision.fp8=hybrid: 14 linears' products in FP8; 2 keep bf16" in log
    assert "mixed_precision.fp8" not in runs["bf16"][1]
    assert fp8 != bf16
    assert fp8 == pytest.approx(bf16, rel=1e-2)
