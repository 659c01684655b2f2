"""A child forked after the parent ran OpenMP-parallel torch ops finishes its own parallel op (without
the hook it hangs for ever in GNU OpenMP: the async-save stall). Run in a fresh interpreter: the test
needs a parent whose OpenMP pool has run, and must not fork the pytest worker."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import multiprocessing as mp, sys, torch
from dfm.platform.fork_safety import forked_children_single_threaded
torch.set_num_threads(2)
x = torch.randn(2000, 2000)
for _ in range(3):
    (x @ x).sum(); torch.randn(4_000_000).add_(1)  # the parent's OpenMP pool runs
if sys.argv[1] == "hooked":
    forked_children_single_threaded()
def child():
    (torch.randn(4_000_000) * 2 + 1).sum()  # a parallel region's size
    sys.exit(torch.get_num_threads())
process = mp.get_context("fork").Process(target=child)
process.start(); process.join(30)
hung = process.is_alive()
process.kill()
print("hung" if hung else f"exit {process.exitcode}")
"""


def forked_child(mode: str) -> str:
    result = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


def test_a_forked_child_runs_parallel_ops_single_threaded():
    # Mutation: without the hook (forked_child("bare")) the child hangs: "hung" (checked 2026-11-28).
    assert forked_child("hooked") == "exit 1"  # the child's exit code is its thread count
