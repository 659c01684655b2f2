"""Fault tests run the real entry point through tests/training/entry.py's helpers."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
