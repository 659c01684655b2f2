"""Per-iteration metrics: one JSON line each in <log_dir>/metrics.jsonl, a readable console line,
and optionally TensorBoard scalars and a Weights & Biases run."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger("dfm.train")


def finite_or_none(value: Any) -> float | None:
    """A metric as metrics.jsonl records it: a float, or None when absent or not finite."""
    return float(value) if value is not None and math.isfinite(float(value)) else None


def fmt(value: Any) -> str:
    """A metric as the console line shows it: n/a for None, 4 significant digits for floats."""
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def open_wandb_run(project: str, name: str | None, log_dir: str, config: dict[str, Any]):
    """A W&B run; ``WANDB_MODE=offline`` and ``WANDB_API_KEY`` are read from the environment by wandb."""
    try:
        import wandb
    except ImportError as error:
        raise ImportError(f"logger.wandb_project={project!r} needs wandb: pip install -e '.[wandb]'") from error
    return wandb.init(project=project, name=name, dir=log_dir, config=config)


class MetricsLog:
    """Writes on the logging rank only; other ranks hold a disabled instance."""

    def __init__(
        self,
        log_dir: str,
        enabled: bool,
        tensorboard_dir: str | None = None,
        wandb_project: str | None = None,
        wandb_name: str | None = None,
        run_config: dict | None = None,
    ):
        self.enabled = enabled
        self.path = Path(log_dir) / "metrics.jsonl"
        self.tb = self.wandb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if tensorboard_dir:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(tensorboard_dir)
            if wandb_project:
                self.wandb = open_wandb_run(wandb_project, wandb_name, log_dir, run_config or {})

    def scalars(self, section: str, record: dict[str, Any]) -> None:
        """Numbers of ``record`` to TensorBoard and W&B as ``<section>/<key>`` at its iteration."""
        values = {
            f"{section}/{k}": v
            for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "iteration"
        }
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(key, value, record["iteration"])
        if self.wandb is not None:
            self.wandb.log(values, step=record["iteration"])

    def write(self, record: dict[str, Any], line: str | None = None) -> None:
        """Append ``record``; the console gets ``line``, or the pretraining line made of it."""
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.scalars("train", record)
        logger.info(line or self.console_line(record))

    def write_validation(self, record: dict[str, Any]) -> None:
        """One line of <log_dir>/validation.jsonl (val loss, per level ``val_loss_t<k>`` at ``val_levels``,
        where the generated sample went); TensorBoard / W&B get ``validation/loss`` and ``validation/loss_t<k>``
        (a distillation's critic: ``validation/loss_critic`` and ``validation/loss_critic_t<k>``)."""
        if not self.enabled:
            return
        with self.path.with_name("validation.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        losses = {k.removeprefix("val_"): v for k, v in record.items() if k.startswith("val_loss")}
        measured = {k: v for k, v in record.items() if "/" in k}  # sample metrics: "<metric>/<name>"
        self.scalars("validation", {"iteration": record["iteration"], **losses, **measured})
        per_level = " ".join(
            f"{level:.3g}:{fmt(record[f'val_loss_t{k}'])}" for k, level in enumerate(record.get("val_levels", []))
        )
        logger.info(
            "validation at iter %d | val loss %s | per level %s | sample %s%s%s",
            record["iteration"],
            fmt(record["val_loss"]),
            per_level or "n/a",
            record["generation"],
            "" if "val_loss_critic" not in record else f" | critic val loss {fmt(record['val_loss_critic'])}",
            "".join(f" | {k} {fmt(v)}" for k, v in measured.items()),
        )

    def media(self, iteration: int, samples: list) -> None:
        """Decoded validation samples (``DecodedSample``: prompt, frames [T, H, W, 3] uint8, file) to
        TensorBoard as ``validation/sample_<k>`` images (a video's frames side by side) and to W&B as
        ``wandb.Image`` / ``wandb.Video`` of the written file, captioned with the prompt."""
        if not self.enabled or not samples:
            return
        if self.tb is not None:
            for k, sample in enumerate(samples):
                strip = np.concatenate(list(sample.frames), axis=1)  # [H, T * W, 3]
                self.tb.add_image(f"validation/sample_{k}", strip, iteration, dataformats="HWC")
                self.tb.add_text(f"validation/prompt_{k}", sample.prompt, iteration)
        if self.wandb is not None:
            import wandb

            logged = {
                f"validation/sample_{k}": wandb.Video(str(s.path), caption=s.prompt)
                if s.frames.shape[0] > 1
                else wandb.Image(s.frames[0], caption=s.prompt)
                for k, s in enumerate(samples)
            }
            self.wandb.log(logged, step=iteration)

    @staticmethod
    def console_line(r: dict[str, Any]) -> str:
        return (
            f"iter {r['iteration']:>6}/{r['train_iters']} | loss {fmt(r['loss'])} | lr {r['lr']:.3g} | "
            f"grad norm {fmt(r['grad_norm'])} | skipped {r['skipped_iterations']} | "
            f"{r['step_time_s'] * 1000:.0f} ms/it | {fmt(r['tokens_per_sec_per_gpu'])} tok/s/gpu | "
            f"{fmt(r['tflops_per_gpu'])} TFLOP/s/gpu | MFU {fmt(r['mfu'])}"
        ) + "".join(  # both Wan 2.2 experts in one run: each one's loss and samples
            f" | loss {expert} {fmt(r[f'loss_{expert}'])} ({r[f'samples_{expert}']})"
            for expert in ("high_noise", "low_noise")
            if f"loss_{expert}" in r
        )

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
