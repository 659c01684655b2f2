"""What scripts/gpu/lease.sh records about the device and what comes back from it.

    python -m benchmarks.lease env OUT.json      # on the device: versions, GPU, the torch APIs dfm uses
    python -m benchmarks.lease unpack FOLDER     # here: FOLDER holds what the call returned (files_at)

``unpack`` extracts FOLDER/parts.tar into benchmarks/results/<device>-<date>/ (device from
environment.json: h100, h200, cpu) and prints, ready for docs/performance.md, each part's ladder
table (benchmarks/report.py), the acceptance figures of issue 30 and the GPU tests' outcome.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import json
import platform
import re
import shutil
import subprocess
import tarfile
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "triton", "megatron-core", "megatron-energon", "diffusers", "transformers", "numpy", "hydra-core")


def torch_api_probes() -> dict[str, bool | str]:
    """The torch APIs dfm calls that a torch older than the one it is developed on may lack."""
    import torch

    probes: dict[str, bool | str] = {"torch._fused_rms_norm": hasattr(torch, "_fused_rms_norm")}
    try:
        from torch.nn.attention.varlen import varlen_attn

        probes["varlen_attn"] = True
        probes["varlen_attn(scale=)"] = "scale" in inspect.signature(varlen_attn).parameters
    except ImportError:
        probes["varlen_attn"] = False
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401

        probes["flex_attention"] = True
    except ImportError:
        probes["flex_attention"] = False
    try:
        from dfm.platform.torch_api import top_saved_tensors_hooks

        probes["top_saved_tensors_hooks"] = top_saved_tensors_hooks() is None
    except Exception as error:  # noqa: BLE001 - recorded
        probes["top_saved_tensors_hooks"] = f"{type(error).__name__}: {error}"
    probes["cpu flash sdpa ops"] = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    return probes


IMPORTS = ("dfm.training.pretrain", "dfm.convert", "diffusers", "megatron.energon", "hydra", "webdataset", "pytest")


def import_probes() -> dict[str, str]:
    """'ok' or the error of importing each module the GPU run needs (a wheel missing from .whl/)."""
    found = {}
    for name in IMPORTS:
        try:
            importlib.import_module(name)
            found[name] = "ok"
        except Exception as error:  # noqa: BLE001 - recorded, the next part shows what it breaks
            found[name] = f"{type(error).__name__}: {error}"
    return found


def versions() -> dict[str, str | None]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def environment() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    smi = shutil.which("nvidia-smi")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.processor() or platform.machine()})",
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "versions": versions(),
        "torch_api": torch_api_probes(),
        "imports": import_probes(),
        "nvidia_smi": subprocess.run([smi], capture_output=True, text=True).stdout if smi else None,
    }


def device_slug(device: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; a CPU -> 'cpu'."""
    match = re.search(r"\b([A-Z]+\d+)", device)
    return match.group(1).lower() if match and not device.startswith("CPU") else "cpu"


def acceptance(rows: dict[str, dict]) -> list[str]:
    """Issue 30's acceptance figures from the ladder rows (by rung name) that ran."""
    from benchmarks.report import _fmt

    lines = []
    h4096, xl2, mix = rows.get("h4096-8k-L6"), rows.get("xl2-256-img"), rows.get("cross-16k-mix-packed")
    if h4096 and "error" not in h4096["dfm"]:
        dfm, ref = h4096["dfm"], h4096.get("reference") or {}
        lines.append(
            f"h4096-8k-L6: {_fmt(dfm['tflops_per_gpu'])} TFLOP/s/GPU (target >= 520), dfm/ref "
            f"{_fmt(h4096['ratio'], 2)} (>= 1.3), peak {_fmt(dfm['peak_mem_gib'])} GiB vs the "
            f"reference's {_fmt(ref.get('peak_mem_gib'))} GiB (no higher)"
        )
    if xl2:
        lines.append(f"xl2-256-img: dfm/ref images/s {_fmt(xl2.get('ratio'), 2)} (target >= 1.5)")
    if mix:
        lines.append(f"cross-16k-mix-packed: mixed/fixed {_fmt(mix.get('mixed_vs_fixed'), 2)} (target >= 0.95)")
    return lines + fp8_lines(rows)


def fp8_lines(rows: dict[str, dict]) -> list[str]:
    """The FP8 rungs against their bf16 runs: TFLOP/s, and step-time ratios to dfm's bf16 and the reference."""
    from benchmarks.report import _fmt

    lines = []
    for name in ("h4096-8k-L6", "xl2-256-img"):
        fp8, bf16 = rows.get(f"{name}-fp8"), rows.get(name)
        if not fp8 or "error" in fp8["dfm"]:
            continue
        step = fp8["dfm"]["step_time_s"]
        line = f"{name}-fp8: {_fmt(fp8['dfm']['tflops_per_gpu'])} TFLOP/s/GPU"
        if bf16 and "error" not in bf16["dfm"]:
            line += f", {_fmt(bf16['dfm']['step_time_s'] / step, 2)}x dfm bf16's steps"
            if bf16.get("reference") and "error" not in bf16["reference"]:
                line += f", {_fmt(bf16['reference']['step_time_s'] / step, 2)}x the bf16 reference's"
        lines.append(line)
    return lines


def report(folder: Path) -> str:
    """Markdown of every part's results.json under ``folder`` and the acceptance lines."""
    from benchmarks.report import markdown_table

    blocks, rows = [], {}
    parts = [json.loads(path.read_text()) for path in folder.rglob("results.json")]
    for data in sorted(parts, key=lambda data: data["environment"]["date"]):  # in the order they ran
        env = data["environment"]
        blocks.append(f"{env['date']} | {env['device']} | torch {env['torch']}\n`{env['command']}`\n\n")
        blocks[-1] += markdown_table(data["rows"]) + "\n"
        rows.update({row["config"]: row for row in data["rows"]})
    log = folder / "tests" / "log.txt"
    lines = log.read_text().strip().splitlines() if log.exists() else []
    outcome = lines[-1] if lines else "not run"
    return "\n".join([f"GPU tests: {outcome}", *acceptance(rows), "", *blocks])


def unpack(returned: Path, results_root: Path = REPO / "benchmarks" / "results") -> Path:
    env = json.loads((returned / "environment.json").read_text())
    target = results_root / f"{device_slug(env['device'])}-lease-{env['date'][:10]}"
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(returned / "parts.tar") as archive:
        archive.extractall(target, filter="data")
    for name in ("environment.json", "summary.txt"):
        if (returned / name).exists():
            shutil.copy(returned / name, target / name)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env").add_argument("out")
    sub.add_parser("report").add_argument("folder")
    sub.add_parser("unpack").add_argument("folder")
    args = parser.parse_args(argv)
    if args.command == "env":
        env = environment()
        Path(args.out).write_text(json.dumps(env, indent=2))
        print(json.dumps({key: value for key, value in env.items() if key != "nvidia_smi"}, indent=1))
    elif args.command == "report":
        print(report(Path(args.folder)))
    else:
        target = unpack(Path(args.folder))
        print(f"unpacked into {target.relative_to(REPO) if target.is_relative_to(REPO) else target}\n")
        print(report(target))


if __name__ == "__main__":
    main()
