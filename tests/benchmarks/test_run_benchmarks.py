"""Smoke test of the benchmark script on CPU: one tiny rung, dfm and reference, table written."""

import json

import pytest
import torch

from benchmarks import run_benchmarks
from benchmarks.ladders import LADDERS, get_ladder
from benchmarks.run_benchmarks import rung_config
from benchmarks.variants import VARIANTS, apply_variant


@pytest.mark.parametrize("ladder", sorted(LADDERS))
def test_every_rung_builds_a_valid_config(ladder):
    """Each rung's pack holds its largest sample (at any size, the rehearsal's included)."""
    for rung in get_ladder(ladder):
        cfg = rung_config(rung, [])
        data, model = cfg.dataset, cfg.model
        shapes = [[1, *size] for size in data.mock_image_sizes] + list(data.mock_video_sizes)
        tokens = max(
            -(-t // model.patch_temporal) * (h // model.patch_spatial) * (w // model.patch_spatial)
            for t, h, w in shapes
        )
        assert data.seq_length >= tokens, (rung.name, data.seq_length, tokens)


def test_every_rung_names_a_known_variant_and_variants_undo_their_patch():
    from dfm.models import attention as packed_attention
    from dfm.models.common import adaln, row_modulation

    patched = [
        (adaln, "rows_to_tokens"),
        (adaln, "sum_rows_by_one_hot_gemm"),
        (row_modulation, "sum_rows_by_one_hot_gemm"),
        (adaln.AdaLNModulation, "forward"),
        (packed_attention, "document_block_mask"),
        (packed_attention, "flex_document_attention"),
    ]
    before = [getattr(owner, name) for owner, name in patched]
    assert all(rung.variant in VARIANTS for ladder in LADDERS for rung in get_ladder(ladder))
    for name in VARIANTS:
        with apply_variant(name):
            pass
    assert [getattr(owner, name) for owner, name in patched] == before


def test_tiny_rung_times_both_sides_and_writes_the_table(tmp_path):
    run_benchmarks.main(
        [
            "--ladder",
            "cpu",
            "--only",
            "tiny-256-mix",
            "--warmup",
            "0",
            "--steps",
            "1",
            "--set",
            "model.num_layers=1",
            "--out",
            str(tmp_path),
        ]
    )
    row = json.loads((tmp_path / "results.json").read_text())["rows"][0]
    assert "error" not in row["dfm"] and "error" not in row["reference"]
    assert row["dfm"]["tokens_per_sec_per_gpu"] > 0 and row["ratio"] > 0
    assert "tiny-256-mix" in (tmp_path / "results.md").read_text()


def test_mixed_vs_fixed_compares_the_same_work_at_each_shapes_fixed_speed():
    from benchmarks.report import mixed_vs_fixed

    fixed = [
        {"config": "a", "dfm": {"flops_by_tokens": {"256": 5.0}, "tflops_per_gpu": 2.0}},
        {"config": "b", "dfm": {"flops_by_tokens": {"1024": 7.0}, "tflops_per_gpu": 1.0}},
    ]
    # 4 units of 256-token work at 2/s and 3 of 1024-token work at 1/s take 5 s in fixed packs.
    mixed = {
        "config": "m",
        "mix_of": ["a", "b"],
        "dfm": {"flops_by_tokens": {"256": 4.0, "1024": 3.0}, "tflops_per_gpu": 7 / 5},
    }
    assert mixed_vs_fixed(mixed, [mixed, *fixed]) == pytest.approx(1.0)
    mixed["dfm"]["tflops_per_gpu"] = 7 / 10  # twice as slow as fixed packs
    assert mixed_vs_fixed(mixed, [mixed, *fixed]) == pytest.approx(0.5)
    assert mixed_vs_fixed(mixed, [mixed, fixed[0]]) is None  # a shape without its fixed rung yet


def test_the_uniform_packs_varlen_variant_sends_uniform_packs_to_the_varlen_kernel(monkeypatch):
    """The 'before' of the landed batched call: a uniform pack reaches torch's varlen kernel (a stand-in
    here: the kernel is CUDA's) instead of ``batched_sdpa``, and the result is the same."""
    from dfm.models.attention import varlen
    from tests.models._helpers import segments
    from tests.models.test_packed_attention import reference_varlen_attn

    calls = []
    monkeypatch.setattr(varlen, "torch_varlen_attn", lambda *a: calls.append(1) or reference_varlen_attn(*a))
    params = segments([16, 16, 16], [16, 16, 16], [16, 16, 16], [16, 16, 16])
    q, k, v = (torch.randn(48, 1, 2, 8) for _ in range(3))
    expected = varlen.varlen_document_attention(q, k, v, params, 0.3)
    with apply_variant("uniform_packs_varlen"):
        got = varlen.varlen_document_attention(q, k, v, params, 0.3)
    assert calls == [1]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
