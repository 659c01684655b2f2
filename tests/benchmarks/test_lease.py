"""What scripts/gpu/lease.sh relies on here: the rehearsal ladder mirrors the gpu ladder at CPU size,
and what a device call returns unpacks into benchmarks/results/ with the acceptance lines."""

import json
import tarfile

from benchmarks import lease
from benchmarks.ladders import get_ladder


def test_the_rehearsal_ladder_is_the_gpu_ladder_at_cpu_size():
    gpu, rehearsal = get_ladder("gpu"), get_ladder("gpu-rehearsal")
    keep = ("name", "variant", "reference", "mix_of")
    assert [[getattr(r, k) for k in keep] for r in rehearsal] == [[getattr(r, k) for k in keep] for r in gpu]
    h4096 = dict(o.split("=", 1) for o in next(r for r in rehearsal if r.name == "h4096-8k-L6").overrides)
    assert h4096["model.hidden_size"] == "64" and h4096["dataset.seq_length"] == "512"
    assert h4096["dataset.mock_video_sizes"] == "[[2,32,32]]"  # 2 x 128 x 128 -> 2 x 32 x 32: 512 tokens


def test_unpack_puts_the_parts_under_results_and_reports_the_targets(tmp_path):
    part = tmp_path / "work" / "accept"
    part.mkdir(parents=True)
    side = {"flops_by_tokens": {"8192": 1e15}, "tflops_per_gpu": 300.0, "peak_mem_gib": 50.0}
    side |= {"step_time_s": 0.5, "tokens_per_sec_per_gpu": 3e4, "samples_per_sec_per_gpu": 4.0, "mfu": 0.3}
    row = {"config": "h4096-8k-L6", "variant": "default", "mix_of": [], "dfm": side, "reference": side, "ratio": 1.0}
    fp8_side = side | {"step_time_s": 0.4, "tflops_per_gpu": 375.0}
    fp8_row = {"config": "h4096-8k-L6-fp8", "variant": "default", "mix_of": [], "dfm": fp8_side, "reference": None}
    env = {"date": "2026-11-28T10:00:00+00:00", "device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "command": "c"}
    (part / "results.json").write_text(json.dumps({"environment": env, "rows": [row, fp8_row]}))
    returned = tmp_path / "returned"
    returned.mkdir()
    with tarfile.open(returned / "parts.tar", "w") as archive:
        archive.add(part, arcname="accept")
    (returned / "environment.json").write_text(json.dumps(env))
    target = lease.unpack(returned, tmp_path / "results")
    assert target == tmp_path / "results" / "h100-lease-2026-11-28"
    assert (target / "accept" / "results.json").exists() and (target / "environment.json").exists()
    printed = lease.report(target)
    assert "h4096-8k-L6: 300.0 TFLOP/s/GPU (target >= 520), dfm/ref 1.00" in printed
    assert "h4096-8k-L6-fp8: 375.0 TFLOP/s/GPU, 1.25x dfm bf16's steps, 1.25x the bf16 reference's" in printed
    assert "| h4096-8k-L6 | default |" in printed and "GPU tests: not run" in printed


def test_the_lease_collects_every_file_with_gpu_tests():
    """lease.sh finds its test files by grep; a file marking its GPU tests another way would silently drop
    out of every lease (the bf16 parity tests did, 2026-11-29)."""
    import re
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = (root / "scripts/gpu/lease.sh").read_text()
    pattern = re.search(r'grep -rlE "([^"]+)" tests', script).group(1)
    found = subprocess.run(
        ["grep", "-rlE", pattern, "tests", "--include=test_*.py"], cwd=root, capture_output=True, text=True
    ).stdout.split()
    uses_gpu_marks = {
        str(path.relative_to(root))
        for path in (root / "tests").rglob("test_*.py")
        if re.search(r"mark\.gpu\b|from tests\.gpu\._device import .*\b(GPU|gpu_test)\b", path.read_text())
        and path.name != "test_lease.py"
    }
    assert uses_gpu_marks <= set(found), sorted(uses_gpu_marks - set(found))
