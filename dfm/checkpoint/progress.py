"""A progress bar over the named stages of a long step that has no inner loop to count
(checkpoint load: reading tensors is one dist_checkpointing call). Rank 0 draws it on stderr."""

from __future__ import annotations

import torch
from tqdm import tqdm


class StageProgress:
    """``with StageProgress("load", ["read", "apply"]) as p: read(); p.advance(); apply(); p.advance()``"""

    def __init__(self, desc: str, stages: list[str]):
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.stages = stages
        self.bar = tqdm(total=len(stages), desc=desc, unit="stage", disable=rank != 0)
        self.bar.set_postfix_str(stages[0])

    def advance(self) -> None:
        """The current stage is finished; show the next one."""
        self.bar.update(1)
        if self.bar.n < len(self.stages):
            self.bar.set_postfix_str(self.stages[self.bar.n])

    def __enter__(self) -> StageProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()
