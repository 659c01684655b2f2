"""Several runs of the real pretrain entry point in one launch (one process, or one torchrun of N ranks):
what the layout tests use to pay Python's and megatron-core's start-up (~8 s of CPU per process) once
per launch instead of once per run.

``_runs_entry.py RUNS`` where RUNS is a JSON list of ``{"argv": [...], "status": path, "weights": path
or null}``: each run parses ``argv`` like ``pretrain_dit_model.py`` and calls ``pretrain`` as that script
does; between runs only megatron's parallel groups are torn down (the next run builds its own layout's),
the default process group stays. ``weights``: after the last step every parameter is saved gathered to its
full tensor (as ``tests/parallel/_weights_entry.py`` does); ``sample`` (optional): a folder for the run's
validation losses and sample, computed at its layout after the last step (``save_validation``). Rank 0 writes "ok" to ``status`` after a run;
a run that fails writes its traceback there and ends the launch (the ranks may disagree on what comes
next), so the caller relaunches the runs that have no status (``tests/training/entry.py: run_entries``).
"""

import json
import logging
import os
import sys
import traceback
from pathlib import Path

_after_training: dict[str, str | None] = {"weights": None, "sample": None}
SAMPLE_STEPS = 2  # EDM's Heun: 3 model calls, each through every stage of the layout
LEVELS = 2  # validation loss levels (train.eval_noise_bins' role)


def save_validation(loop, folder: str) -> None:
    """One evaluation at the run's layout after the last step, the trainer's own (``TrainLoop.validate``)
    with ``LEVELS`` levels over the first 2 validation packs of the global stream (2 / DP per rank) and a
    ``SAMPLE_STEPS``-step sample: the losses go to ``<log_dir>/validation.jsonl``, the sample to
    ``folder/validation_generation/iter_0000000_dp<R>.pt``."""
    import dataclasses

    cfg = loop.cfg
    train = dataclasses.replace(
        cfg.train, eval_iters=2 // loop.layout.dp, eval_noise_bins=LEVELS, eval_sampling_steps=SAMPLE_STEPS
    )
    loop.cfg = dataclasses.replace(cfg, train=train, checkpoint=dataclasses.replace(cfg.checkpoint, save=folder))
    try:
        loop.validate(0)
    finally:
        loop.cfg = cfg


def _save_after_training() -> None:
    from dfm.training.full_weights import save_full_weights
    from dfm.training.pretrain import TrainLoop

    train = TrainLoop.run

    def run(self, start: int) -> None:
        train(self, start)  # process groups are still up afterwards
        if _after_training["weights"]:
            save_full_weights(self.model, _after_training["weights"])
        if _after_training["sample"]:
            save_validation(self, _after_training["sample"])

    TrainLoop.run = run


def _keep_default_process_group() -> None:
    """pretrain() tears down megatron's groups only; the default group serves the next run."""
    from megatron.core import parallel_state

    import dfm.training.pretrain as pretrain_module

    pretrain_module.destroy_distributed = parallel_state.destroy_model_parallel


def main(runs_file: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    import torch

    from dfm.config.cli import config_or_exit
    from dfm.platform.distributed import destroy_distributed
    from dfm.training.pretrain import pretrain

    _save_after_training()
    _keep_default_process_group()
    rank = int(os.environ.get("RANK", "0"))
    for run in json.loads(Path(runs_file).read_text()):
        if Path(run["status"]).exists():
            continue  # done by an earlier launch
        print(f"=== run {run['status']}: {' '.join(run['argv'])}", flush=True)
        print(f"=== run {run['status']}", file=sys.stderr, flush=True)
        _after_training.update(weights=run.get("weights"), sample=run.get("sample"))
        try:
            cfg, args = config_or_exit(run["argv"])
            pretrain(cfg, mock=args.mock, explicit_keys=args.explicit_keys())
        except BaseException:
            Path(run["status"]).write_text(f"rank {rank}:\n{traceback.format_exc()}")
            sys.stderr.flush()
            os._exit(1)
        torch.distributed.barrier()
        if rank == 0:
            Path(run["status"]).write_text("ok")
    destroy_distributed()


if __name__ == "__main__":  # dist_checkpointing starts worker processes: keep this guard
    main(sys.argv[1])
