"""tests/rank_launcher.py starts ranks as torchrun's workers see them, and ends them all when one fails."""

from __future__ import annotations

import subprocess
import time

from tests.rank_launcher import launcher_command

RANK = """
import os, sys, time
env = os.environ
# One write a rank: print() writes its pieces one by one when the stream is unbuffered (python -u).
sys.stdout.write(f"{env['RANK']} {env['LOCAL_RANK']} {env['WORLD_SIZE']} {env['MASTER_PORT'] != ''}\\n")
sys.stdout.flush()
if os.environ["RANK"] == sys.argv[1]:
    sys.exit(7)
time.sleep(float(sys.argv[2]))
"""


def launch(tmp_path, failing: str, seconds: float) -> subprocess.CompletedProcess:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    command = [*launcher_command(3), str(script), failing, str(seconds)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_every_rank_gets_its_rank_and_the_rendezvous(tmp_path):
    done = launch(tmp_path, failing="none", seconds=0)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["0 0 3 True", "1 1 3 True", "2 2 3 True"]


def test_a_failing_rank_ends_the_others_and_the_launch_fails(tmp_path):
    started = time.monotonic()
    done = launch(tmp_path, failing="1", seconds=300)
    assert done.returncode == 1 and "rank 1 failed, exitcode : 7" in done.stderr
    assert time.monotonic() - started < 60  # the others were ended, not waited for
