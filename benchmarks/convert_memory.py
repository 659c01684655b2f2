"""Peak host memory of convert_wan.py on a Wan2.1-T2V-1.3B-shaped model with random weights (never downloaded).

    python -m benchmarks.convert_memory --workdir /tmp/convert_memory [--layers 30] [--json out.json]

1. A diffusers ``WanTransformer3DModel`` folder of the published 1.3B config is written with random bf16
   weights, one tensor at a time (the model is built on meta for its names and shapes only).
2. ``convert_wan.py import --verify`` (checkpoint in fp32, the default precision) and ``export`` (default
   dtype: the imported bf16) each run in a fresh process; its peak RSS (``ru_maxrss``) minus that of a
   process that only imports the same modules is compared with the larger model's bytes (the fp32
   checkpoint: the import's output and the export's input).
3. The export is compared with the source tensor by tensor: names, dtype and bits.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

# huggingface.co/Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json
WAN_13B = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=8960,
    num_layers=30,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
SHARD_BYTES = 2**30  # the source folder's shards (published folders are sharded too)
IMPORTS = (
    "import diffusers, accelerate; diffusers.WanTransformer3DModel; "
    "import megatron.core.dist_checkpointing; import dfm.convert.cli, dfm.convert.wan, dfm.platform.distributed"
)


def write_source(folder: Path, num_layers: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """A random ``WAN_13B`` folder, written tensor by tensor; returns its tensor bytes."""
    import diffusers

    from dfm.convert.diffusers_folder import write_diffusers_folder_streaming

    with torch.device("meta"):
        model = diffusers.WanTransformer3DModel(**{**WAN_13B, "num_layers": num_layers})
    config = {"_class_name": "WanTransformer3DModel", **dict(model.config)}
    plan = {name: (dtype, tuple(t.shape)) for name, t in model.state_dict().items()}

    def tensors():
        for index, (name, (_, shape)) in enumerate(plan.items()):
            generator = torch.Generator().manual_seed(index)
            yield name, (torch.randn(shape, generator=generator) * 0.02).to(dtype)

    write_diffusers_folder_streaming(folder, json.loads(json.dumps(config)), plan, tensors(), SHARD_BYTES)
    return sum(torch.empty(shape, dtype=dtype, device="meta").nbytes for _, shape in plan.values())


def measured(code: str) -> dict:
    """Run ``code`` in a fresh python; its peak RSS and its children's (bytes), wall seconds, stdout."""
    probe = (
        f"{code}\nimport resource, json\n"
        "print('PEAK ' + json.dumps([resource.getrusage(r).ru_maxrss * 1024 for r in "
        "(resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]))"
    )
    start = time.time()
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{code!r} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    line = next(line for line in result.stdout.splitlines() if line.startswith("PEAK "))
    self_peak, children_peak = json.loads(line[5:])
    return dict(peak=self_peak, children_peak=children_peak, seconds=round(time.time() - start, 1), out=result.stdout)


def converter(argv: list[str]) -> str:
    return (
        f"{IMPORTS}\nfrom dfm.convert.cli import main; from dfm.convert.wan import WAN\nassert main(WAN, {argv!r}) == 0"
    )


def round_trip_exact(source: Path, export: Path) -> tuple[bool, list[str]]:
    """(every tensor bit-equal with its dtype, the export's dtypes) read one tensor at a time."""
    from dfm.convert.diffusers_folder import DiffusersWeights

    a, b = DiffusersWeights(source), DiffusersWeights(export)
    if sorted(a.names()) != sorted(b.names()):
        return False, []
    dtypes = set()
    for name in a.names():
        x, y = a.read(name), b.read(name)
        dtypes.add(str(y.dtype))
        if x.dtype != y.dtype or not torch.equal(x, y):
            return False, sorted(dtypes)
    return True, sorted(dtypes)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="scratch folder (~4x the bf16 model bytes)")
    parser.add_argument("--layers", type=int, default=WAN_13B["num_layers"])
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    source, checkpoint, export = args.workdir / "source", args.workdir / "imported", args.workdir / "export"
    source_bytes = write_source(source, args.layers)
    checkpoint_bytes = 2 * source_bytes  # fp32
    baseline = measured(IMPORTS)
    text = ["model.max_text_len=16", "dataset.mock_text_len_range=[4,12]"]
    imported = measured(
        converter(["import", "--diffusers", str(source), "--output", str(checkpoint), "--verify", *text])
    )
    exported = measured(converter(["export", "--checkpoint", str(checkpoint), "--output", str(export)]))
    exact, dtypes = round_trip_exact(source, export)
    larger = max(source_bytes, checkpoint_bytes)
    result = dict(
        model=f"Wan2.1-T2V-1.3B-shaped WanTransformer3DModel, {args.layers} layers, random bf16 weights",
        source_bytes=source_bytes,
        checkpoint_bytes=checkpoint_bytes,
        baseline_peak=baseline["peak"],
        verify_line=next(line for line in imported["out"].splitlines() if "max abs diff" in line),
        round_trip_exact=exact,
        export_dtypes=dtypes,
    )
    for phase, run in (("import_verify", imported), ("export", exported)):
        extra = run["peak"] - baseline["peak"]
        result[phase] = dict(
            peak=run["peak"],
            children_peak=run["children_peak"],
            seconds=run["seconds"],
            peak_minus_baseline=extra,
            over_larger_model=round(extra / larger, 3),
        )
        print(f"{phase}: peak RSS - import-only = {extra / 2**30:.2f} GiB = {extra / larger:.3f}x the larger model")
    print(f"round trip exact: {exact}, export dtypes {dtypes}; {result['verify_line']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
