"""Checkpoints: the on-disk protocol (``files``, ``manifest``), what is saved (``state``), and the
save / load steps (``save``, ``load``). ``python -m dfm.checkpoint verify DIR`` checks checkpoints.

Nothing here imports ``dfm.training``: inference loads weights through this package alone.
"""
