"""A stall's dump shows the stacks of the processes the rank forked (a stuck checkpoint writer): each forked
child writes its own on request; a descendant that did not register for it is not sent the signal."""

from __future__ import annotations

import subprocess
import sys

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
