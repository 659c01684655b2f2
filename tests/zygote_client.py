"""``python -S tests/zygote_client.py SOCKET [-u] (SCRIPT | -m MODULE) [ARGS...]``: run a Python script as a
child of the shared-import server (tests/zygote.py), standing in for it: the same stdio, environment and
working directory; stop signals forwarded; the child's exit status as its own. Where the server is gone or
declines the request, the script runs as a plain ``python`` process in this one's place (exec).

Standard library only, and started with ``-S``: this process must cost next to nothing.
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def plain(argv: list[str]) -> None:
    """Become ``python ARGV`` (site imports and all)."""
    os.execv(sys.executable, [sys.executable, *argv])


def request(server: socket.socket, replies, argv: list[str]) -> dict:
    message = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    fds = array.array("i", [0, 1, 2])
    server.sendmsg([len(message).to_bytes(8, "big") + message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    return read_reply(replies)


def read_reply(replies) -> dict:
    """The next reply line. ``replies`` is the socket's buffered reader: a child that exits at once has its
    status sent right behind its pid, and both can arrive in one read."""
    line = replies.readline()
    if not line.endswith(b"\n"):
        raise ConnectionError("the zygote closed the connection")
    return json.loads(line)


def exit_like(status: int) -> None:
    """Exit as the child did: its exit code, or death by its signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def forward(child: int, sig: int) -> None:
    try:
        os.kill(child, sig)
    except ProcessLookupError:  # already gone: its status is on its way
        pass


def main(argv: list[str]) -> None:
    path, argv = argv[0], argv[1:]
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.connect(path)
        replies = server.makefile("rb")
        reply = request(server, replies, argv)
    except OSError:
        plain(argv)
    if "pid" not in reply:
        plain(argv)
    child = reply["pid"]
    for sig in FORWARDED:
        signal.signal(sig, lambda received, _frame: forward(child, received))
    try:
        status = read_reply(replies)["status"]
    except ConnectionError:  # the server died: the child died with it
        os._exit(1)
    exit_like(status)


if __name__ == "__main__":
    main(sys.argv[1:])
