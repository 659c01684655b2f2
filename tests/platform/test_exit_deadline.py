"""A process whose main thread is stuck in C code (as a rank in a gloo wait, or joining a checkpoint writer
that never ends) still ends after a stop signal: its Python handler never runs there, but the exit deadline
reads the signal from the wakeup fd, writes the stacks and exits 3 once ``timeout_s`` has passed."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from dfm.platform.exit_deadline import ExitDeadline
from dfm.platform.watchdog import STALL_EXIT_CODE

STUCK = """
import ctypes, os, signal, sys
from dfm.platform.exit_deadline import ExitDeadline
signal.signal(signal.SIGTERM, lambda *_: None)  # as the preemption handler: records and returns
signal.signal(signal.SIGUSR2, lambda *_: None)  # another handled signal: no countdown
ExitDeadline(float(sys.argv[1]), [signal.SIGTERM, signal.SIGUSR1]).arm()
child = os.fork()
if child == 0:  # a forked child's signals must not reach the parent's deadline
    os._exit(0 if signal.set_wakeup_fd(-1) == -1 else 1)
assert os.waitpid(child, 0)[1] == 0
print("stuck", flush=True)
mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER on glibc
ctypes.CDLL(None).pthread_mutex_lock(mutex)
ctypes.CDLL(None).pthread_mutex_lock(mutex)  # for ever, in C: Python runs no signal handler here
"""


def test_sigterm_ends_a_process_stuck_in_c_with_its_stacks():
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK, "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline() == "stuck\n"
        proc.send_signal(signal.SIGUSR2)
        time.sleep(2.5)  # past the timeout, but no stop signal yet: no countdown
        assert proc.poll() is None
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == STALL_EXIT_CODE, stderr
    assert time.monotonic() - sent < 30
    assert "still running 1 s after SIGTERM (train.exit_signal_timeout_s=1)" in stderr, stderr
    stuck_line = len(STUCK.splitlines())  # the second lock, the script's last line
    assert f'File "<string>", line {stuck_line} in <module>' in stderr, stderr  # the stuck frame (faulthandler)


def test_disarming_gives_the_wakeup_fd_back():
    before = signal.set_wakeup_fd(-1)
    try:
        deadline = ExitDeadline(0.1, [signal.SIGUSR1]).arm()
        deadline.disarm()
        assert signal.set_wakeup_fd(-1) == -1 and not deadline.signalled.is_set()
    finally:
        signal.set_wakeup_fd(before)
