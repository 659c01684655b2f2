"""The digits demonstration package lives next to its recipe (examples/), not in the library."""

import sys
from pathlib import Path

RECIPE_DIR = Path(__file__).resolve().parents[2] / "examples" / "megatron" / "recipes" / "dit"
sys.path.insert(0, str(RECIPE_DIR))
