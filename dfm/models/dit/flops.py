"""``dit_training_flops``, where dfm/training/pretrain.py imports it from: the training FLOPs of a
pack of any family (dfm/models/flops.py; the DiT family's count is dit_flops.py)."""

from __future__ import annotations

from dfm.models.flops import training_flops as dit_training_flops

__all__ = ["dit_training_flops"]
