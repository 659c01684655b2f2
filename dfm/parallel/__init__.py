"""The parallel layout: sizes, their rules, and what follows from them (see layout.py)."""

from dfm.parallel.layout import ParallelLayout, launched_world_size, layout_of

__all__ = ["ParallelLayout", "launched_world_size", "layout_of"]
