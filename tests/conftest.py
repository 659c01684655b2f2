"""The longest test files first: with ``-n 2 --dist loadfile`` (the README's command) each worker takes
the next file when it finishes one, so files that run for minutes must not be the last ones handed out
(one worker would run them alone at the end). Files keep their own order of tests; the rest keep
collection order."""

from __future__ import annotations

# Files that take minutes on the 2-core CPU machine (the README command's --durations), longest first.
LONGEST_FIRST = (
    "tests/learning/test_video_learn.py",
    "tests/learning/test_digits_learn.py",
    "tests/parallel/test_fsdp_layouts.py",
    "tests/parallel/test_layout_equivalence.py",
    "tests/faults/test_preemption_signals.py",
    "tests/faults/test_checkpoint_faults.py",
    "tests/slurm/test_sbatch_launcher.py",
    "tests/parallel/test_fsdp_resume.py",
    "tests/training/test_checkpoint_resume.py",
)


def pytest_collection_modifyitems(session, config, items) -> None:
    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each file's tests stay in order, other files in collection order
