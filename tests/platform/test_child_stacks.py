"""A stall's dump shows the stacks of the processes the rank forked (a stuck checkpoint writer): each forked
child writes its own on request; a descendant that did not register for it is not sent the signal."""

from __future__ import annotations

import subprocess
import sys
import time

PARENT = """
import ctypes, os, subprocess, sys, time
from dfm.platform.child_stacks import ask_children_for_stacks, children_write_stacks_on_request
children_write_stacks_on_request()
other = subprocess.Popen(["sleep", "60"])  # exec'd: not registered, must not be sent the signal
writer = os.fork()
if writer == 0:
    def stuck_in_the_writer():
        mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER on glibc
        ctypes.CDLL(None).pthread_mutex_lock(mutex)
        ctypes.CDLL(None).pthread_mutex_lock(mutex)  # for ever, in C
    stuck_in_the_writer()
time.sleep(1)  # the child has registered by the time fork returns; give it time to get stuck
asked = ask_children_for_stacks()
print(asked == [writer], other.poll() is None, flush=True)
os.kill(writer, 9)
other.kill()
"""


def test_a_forked_child_writes_its_stacks_on_request():
    result = subprocess.run([sys.executable, "-c", PARENT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "True True\n", result.stdout + result.stderr
    assert "Python stacks of the child processes" in result.stderr
    assert "in stuck_in_the_writer" in result.stderr, result.stderr  # the child's stuck frame


DUMPER = """
import sys, time
from dfm.platform.watchdog import dump_stacks
name = sys.argv[1]
def nest(depth):
    if depth:
        return nest(depth - 1)
    start = float(sys.argv[2])  # both processes dump at the same instant
    while time.time() < start:
        pass
    dump_stacks("dump of " + name)
exec(f"def frame_of_{name}(): nest(60)")
globals()[f"frame_of_{name}"]()
"""


def test_ranks_sharing_a_log_write_their_dumps_whole(tmp_path):
    """Two ranks' simultaneous dumps into one log (as two ranks' stderr under one launcher) come one after the
    other, each in one piece, instead of interleaved character by character (seen in the stall test's log)."""
    log = tmp_path / "stderr"
    with log.open("w") as shared:
        start = str(time.time() + 5.0)  # after both have started
        command = [sys.executable, "-c", DUMPER]
        procs = [subprocess.Popen([*command, f"rank{r}", start], stderr=shared) for r in range(2)]
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    text = log.read_text()
    for rank in ("rank0", "rank1"):
        assert f"dump of {rank}\n" in text and f"in frame_of_{rank}\n" in text, text
        start = text.index(f"dump of {rank}")
        other = "rank1" if rank == "rank0" else "rank0"
        piece = text[start : text.index(f"in frame_of_{rank}\n")]
        assert f"frame_of_{other}" not in piece and text.count("in nest\n") == 2 * 61, text[:2000]


CRASHER = """
import ctypes
from dfm.platform.child_stacks import crash_writes_stacks
crash_writes_stacks()
def dies_in_c():
    ctypes.string_at(0)  # reads address 0: SIGSEGV, as a crash in a kernel or a collective would
dies_in_c()
"""


def test_a_process_killed_by_a_fatal_signal_writes_where_it_was():
    """A rank that segfaults still dies by the signal (the launcher sees -11), now with its Python stack."""
    result = subprocess.run([sys.executable, "-c", CRASHER], capture_output=True, text=True, timeout=120)
    assert result.returncode == -11, result.stderr
    assert "Segmentation fault" in result.stderr, result.stderr
    assert "in dies_in_c" in result.stderr, result.stderr
