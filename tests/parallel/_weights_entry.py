"""The real entry point that, after the last step, saves every parameter gathered to its full tensor
under its global name (``dfm.training.full_weights``) to the file named by DFM_TEST_FULL_WEIGHTS.

What the layout-equivalence tests compare across layouts; small models only.
"""

import os
import runpy
import sys
from pathlib import Path

ENTRY = Path(__file__).resolve().parents[2] / "examples" / "megatron" / "recipes" / "dit" / "pretrain_dit_model.py"


def save_full_weights_after_training(path: str) -> None:
    from dfm.training.full_weights import save_full_weights
    from dfm.training.pretrain import TrainLoop

    train = TrainLoop.run

    def run(self, start: int) -> None:
        train(self, start)
        save_full_weights(self.model, path)  # process groups are still up: pretrain() tears them down

    TrainLoop.run = run


if __name__ == "__main__":  # dist_checkpointing starts worker processes: keep this guard
    save_full_weights_after_training(os.environ["DFM_TEST_FULL_WEIGHTS"])
    sys.argv = [str(ENTRY), *sys.argv[1:]]
    runpy.run_path(str(ENTRY), run_name="__main__")
