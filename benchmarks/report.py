"""Turn timings into the results table: tokens/s/GPU, TFLOP/s/GPU, MFU, memory, ratio."""

from __future__ import annotations

from benchmarks.timing import Timing
from dfm.models.flops import training_flops


def side_metrics(cfg, timing: Timing, gpus_sharing: int, peak: float | None) -> dict:
    """Per-GPU figures of one side; ``gpus_sharing`` = GPUs that split these packs (TP x CP x PP)."""
    by_tokens = flops_by_tokens(cfg, timing, gpus_sharing)
    tflops = sum(by_tokens.values()) / timing.elapsed_s / 1e12
    return {
        "flops_by_tokens": by_tokens,
        "step_time_s": timing.step_time_s,
        "tokens_per_sec_per_gpu": sum(timing.video_lens) / gpus_sharing / timing.elapsed_s,
        "samples_per_sec_per_gpu": len(timing.video_lens) / gpus_sharing / timing.elapsed_s,
        "tflops_per_gpu": tflops,
        "mfu": None if peak is None else tflops * 1e12 / peak,
        "peak_mem_gib": timing.peak_mem_gib,
    }


def flops_by_tokens(cfg, timing: Timing, gpus_sharing: int) -> dict[str, float]:
    """Training FLOPs per GPU of the timed samples, summed by the samples' video-token count."""
    by_tokens: dict[str, float] = {}
    for video, text in zip(timing.video_lens, timing.text_lens):
        by_tokens[str(video)] = (
            by_tokens.get(str(video), 0.0) + training_flops(cfg.model, [video], [text]) / gpus_sharing
        )
    return by_tokens


def mixed_vs_fixed(row: dict, rows: list[dict]) -> float | None:
    """A mixed rung's speed over what its samples would take in fixed-size packs: each sample
    shape (token count) at the TFLOP/s of the ``mix_of`` rung that holds only that shape, so the
    work compared is the same (1.0: packing mixed shapes costs nothing; the target is >= 0.95)."""
    speeds = {}
    for side in (r["dfm"] for r in rows if r["config"] in row["mix_of"]):
        if "error" in side or len(side["flops_by_tokens"]) != 1:
            return None
        speeds[next(iter(side["flops_by_tokens"]))] = side["tflops_per_gpu"]
    mixed = row["dfm"]
    if "error" in mixed or not set(mixed["flops_by_tokens"]) <= set(speeds):
        return None
    fixed_time = sum(flops / speeds[tokens] for tokens, flops in mixed["flops_by_tokens"].items())
    mixed_time = sum(mixed["flops_by_tokens"].values()) / mixed["tflops_per_gpu"]
    return fixed_time / mixed_time


def ratio(dfm: dict, reference: dict | None) -> float | None:
    """dfm / reference throughput on the same samples (tokens/s per GPU)."""
    if not reference or "error" in reference or "error" in dfm:
        return None
    return dfm["tokens_per_sec_per_gpu"] / reference["tokens_per_sec_per_gpu"]


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) >= 0.01 or value == 0 else f"{value:.2e}"
    return str(value)


COLUMNS = (
    ("rung", None, "config"),
    ("variant", None, "variant"),
    ("tokens/sample", None, "tokens_per_sample"),
    ("step s", "dfm", "step_time_s", 3),
    ("tok/s/GPU", "dfm", "tokens_per_sec_per_gpu", 0),
    ("samples/s/GPU", "dfm", "samples_per_sec_per_gpu", 1),
    ("TFLOP/s/GPU", "dfm", "tflops_per_gpu", 2),
    ("MFU", "dfm", "mfu", 3),
    ("peak GiB", "dfm", "peak_mem_gib", 1),
    ("ref step s", "reference", "step_time_s", 3),
    ("ref tok/s/GPU", "reference", "tokens_per_sec_per_gpu", 0),
    ("ref TFLOP/s", "reference", "tflops_per_gpu", 2),
    ("ref GiB", "reference", "peak_mem_gib", 1),
    ("dfm/ref", None, "ratio", 2),
    ("mixed/fixed", None, "mixed_vs_fixed", 2),
)


def _cell(row: dict, side, key, digits=1) -> str:
    source = row if side is None else (row.get(side) or {})
    if "error" in source and side is not None:
        return source["error"][:24]
    return _fmt(source.get(key), digits)


def markdown_table(rows: list[dict]) -> str:
    header = "| " + " | ".join(c[0] for c in COLUMNS) + " |"
    rule = "|" + "|".join(" --- " for _ in COLUMNS) + "|"
    body = ["| " + " | ".join(_cell(row, *c[1:]) for c in COLUMNS) + " |" for row in rows]
    return "\n".join([header, rule, *body])
