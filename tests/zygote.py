"""Shared imports for the processes the tests start: a server (one per pytest process) that imports torch,
megatron-core and dfm's trainer once, then forks a child for each script a test runs.

Each training process a test starts otherwise spends ~5 CPU s importing before its first step; the suite
starts ~200 of them. ``python_args()`` gives the interpreter arguments that run a script through the
server: ``[sys.executable, *python_args(), script, *args]`` behaves as ``python script args`` would. The
child gets the request's argv, environment, working directory and stdio (the file descriptors
themselves), a fresh process group and freshly seeded ``random`` / numpy; it runs the script as
``__main__`` and exits as Python would (non-daemon threads joined, atexit run, streams flushed). The
server has run nothing but imports when it forks (no threads, no OpenMP pool). A small stdlib-only
client (tests/zygote_client.py) stands in for the child: the test's process object, its stop signals
(forwarded) and its exit status (the child's). A request whose environment differs from the server's in
what acts at start-up or import (``PYTHON*``, thread counts, allocator and loader settings, ``TORCH*``)
runs as a plain process instead, as does any command line other than ``[-u] SCRIPT|-m MODULE ...``.

``DFM_TEST_ZYGOTE=0`` turns it off (every script a plain process).
"""

from __future__ import annotations

import array
import atexit
import ctypes
import gc
import io
import json
import os
import random
import runpy
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from pathlib import Path

CLIENT = Path(__file__).resolve().parent / "zygote_client.py"
REPO_ROOT = Path(__file__).resolve().parents[1]
SWITCH = "DFM_TEST_ZYGOTE"
# Environment read when a process starts or imports (the server imported with its own values).
# (Not TORCHELASTIC_*: the launcher's, read at run time.)
START_UP_PREFIXES = (
    *("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "MALLOC_", "LD_", "GLIBC_"),
    *("TORCH_", "TORCHDYNAMO", "TORCHINDUCTOR", "CUDA"),
)
PRELOAD = (  # what a tiny training run imports, heaviest first (python -X importtime)
    "torch",
    "megatron.core",
    "dfm.config.cli",
    "dfm.training.pretrain",
    "multistorageclient.cache",
    "multistorageclient.client",
    "hydra.core.override_parser.overrides_parser",
    "psutil",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.energon",
)
PR_SET_PDEATHSIG = 1
# With it set, torch.cuda.is_available() / device_count() ask NVML rather than the CUDA runtime, whose
# cudaGetDeviceCount marks every later fork unable to use CUDA ("Cannot re-initialize CUDA in forked
# subprocess"): set for the server's imports only.
NVML_CUDA_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
START_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 30.0

_server: dict = {}  # this pytest process's server: "process", "socket"


# --- the test side ----------------------------------------------------------------------------------


def python_args() -> list[str]:
    """Interpreter arguments that run ``SCRIPT ARGS`` (or ``-m MODULE ARGS``) through this process's server,
    started on first use; ``[]`` (a plain process) when it is switched off or could not start."""
    if os.environ.get(SWITCH, "1") == "0":
        return []
    if "socket" not in _server:
        _server["socket"] = start_server()
    path = _server["socket"]
    return ["-S", str(CLIENT), path] if path else []


def checkout_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this checkout first on PYTHONPATH: a child imports this dfm and ``tests``, whatever is
    installed (the same string for every caller, so the server serves them all)."""
    paths = env.get("PYTHONPATH", "").split(os.pathsep)
    if paths[0] == str(REPO_ROOT):
        return dict(env)
    return {**env, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, paths)])}


def start_server() -> str | None:
    _server["folder"] = tempfile.mkdtemp(prefix="dfm-zygote-")
    path = os.path.join(_server["folder"], "socket")
    env = checkout_env({**os.environ, "OMP_NUM_THREADS": "1"})  # the tests' training processes run one thread
    with open(os.path.join(os.path.dirname(path), "server.log"), "w") as log:  # import warnings, its errors
        process = subprocess.Popen(
            [sys.executable, __file__, path], env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log
        )
    _server["process"] = process
    atexit.register(stop_server)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        if os.path.exists(path):
            return path
        time.sleep(0.05)
    stop_server()
    return None


def stop_server() -> None:
    process = _server.get("process")
    if process is not None and process.poll() is None:
        process.terminate()
        process.wait(timeout=30)
    if _server.get("folder"):
        shutil.rmtree(_server["folder"], ignore_errors=True)


# --- the server ---------------------------------------------------------------------------------------


def serve(path: str) -> None:
    """Import PRELOAD, then fork a child per request until the parent (the pytest process) exits."""
    defaults = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)}
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    startup_env = dict(os.environ)
    os.environ[NVML_CUDA_CHECK] = "1"
    preload()
    os.environ.pop(NVML_CUDA_CHECK)
    if NVML_CUDA_CHECK in startup_env:
        os.environ[NVML_CUDA_CHECK] = startup_env[NVML_CUDA_CHECK]
    if threading.active_count() != 1:
        raise SystemExit(f"zygote: importing started threads {threading.enumerate()}: forking is unsafe")
    if not forked_children_can_use_cuda():  # the test side then runs every script as a plain process
        raise SystemExit("zygote: the imports initialised CUDA, which a forked child cannot use")
    gc.collect()
    gc.freeze()  # a child's garbage collections leave the shared pages shared
    # What importing set (megatron: TORCHINDUCTOR_CACHE_DIR), as it would in a fresh process.
    set_by_imports = {key: value for key, value in os.environ.items() if key not in startup_env}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the test side waits for this name
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}  # child pid -> its client's connection
    try:
        loop(listener, selector, (wake_read, wake_write), children, (startup_env, set_by_imports), defaults)
    finally:
        for pid in children:
            kill_group(pid)


def loop(listener, selector, wake: tuple[int, int], children: dict, envs: tuple[dict, dict], defaults: dict) -> None:
    wake_read = wake[0]

    def release_in_child(connection: socket.socket) -> None:
        """What the server holds, let go in a child (detached: collecting the objects closes nothing)."""
        for held in (connection, listener, *children.values()):
            os.close(held.detach())
        selector.close()
        for fd in wake:
            os.close(fd)

    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                connection, _ = listener.accept()
                connection.settimeout(REQUEST_TIMEOUT_S)  # a client that connects and never asks stalls no one
                try:
                    pid = start_child(connection, envs, defaults, release_in_child)
                except Exception as error:  # noqa: BLE001  it died mid-request or sent garbage: it gets nothing
                    print(f"zygote: a request failed: {error!r}", file=sys.stderr, flush=True)
                    pid = None
                if pid is None:
                    connection.close()
                else:
                    children[pid] = connection
                    selector.register(connection, selectors.EVENT_READ, pid)
            elif key.fileobj is wake_read:
                os.read(wake_read, 4096)
                reap(children, selector)
            else:  # a client hung up (killed): its child goes with it
                kill_group(key.data)
                selector.unregister(key.fileobj)


_exit_hooks: list[tuple] = []  # (func, args, kwargs) the imports registered with atexit, in order


def preload() -> None:
    """Import PRELOAD, recording what the imports register with atexit (a child re-registers it: ``own_exit_hooks``)."""
    register = atexit.register

    def recorded(func, *args, **kwargs):
        _exit_hooks.append((func, args, kwargs))
        return register(func, *args, **kwargs)

    atexit.register = recorded
    try:
        for name in PRELOAD:
            try:
                __import__(name)
            except ImportError:
                pass
    finally:
        atexit.register = register


def forked_children_can_use_cuda() -> bool:
    """Whether a child forked now may initialise CUDA (torch marks children bad once the parent touched it)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda._is_compiled():
        return True
    pid = os.fork()
    if pid == 0:
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def own_exit_hooks() -> None:
    """In a child: the exit hooks a fresh process's imports would have registered, except the removal of
    the server's temporary directories (wandb's media folder: the first child to exit would delete it
    under the others). Their weakref finalizers are detached for the same reason."""
    atexit._clear()
    for func, args, kwargs in _exit_hooks:
        if not isinstance(getattr(func, "__self__", None), tempfile.TemporaryDirectory):
            atexit.register(func, *args, **kwargs)
    for finalizer, info in list(weakref.finalize._registry.items()):
        if getattr(info.func, "__func__", None) is tempfile.TemporaryDirectory._cleanup.__func__:
            finalizer.detach()


def reap(children: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        kill_group(pid)  # what the child left in its group (as the tests' launchers kill a run's group)
        connection = children.pop(pid, None)
        if connection is None:
            continue
        try:
            selector.unregister(connection)
        except KeyError:
            pass
        try:
            connection.sendall(json.dumps({"status": status}).encode() + b"\n")
        except OSError:
            pass
        connection.close()


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def start_child(connection: socket.socket, envs: tuple[dict, dict], defaults: dict, release_in_child) -> int | None:
    """Read one request; fork its child -> the child's pid, or None when declined (the client runs it plain).

    ``envs``: the server's environment before its imports, and what they added to it."""
    request, fds = receive(connection)
    startup_env, set_by_imports = envs
    reason = decline(request, startup_env)
    if reason:
        connection.sendall(json.dumps({"declined": reason}).encode() + b"\n")
        for fd in fds:
            os.close(fd)
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            signal.set_wakeup_fd(-1)
            for sig, handler in defaults.items():
                signal.signal(sig, handler)
            release_in_child(connection)
            run_child({**request, "env": {**set_by_imports, **request["env"]}}, fds)
        finally:
            os._exit(70)  # run_child does not return; an error before it got there
    for fd in fds:
        os.close(fd)
    connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return pid


def receive(connection: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    data, ancillary, _, _ = connection.recvmsg(1 << 20, socket.CMSG_LEN(3 * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    size = int.from_bytes(data[:8], "big")
    data = data[8:]
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            for fd in fds:
                os.close(fd)
            raise ConnectionError("the client hung up mid-request")
        data += chunk
    return json.loads(data), list(fds)


def decline(request: dict, startup_env: dict) -> str | None:
    argv = request["argv"]
    rest = argv[1:] if argv[:1] == ["-u"] else argv
    if not rest or (rest[0].startswith("-") and rest[0] != "-m") or rest[:1] == ["-m"] and len(rest) < 2:
        return f"command line {argv[:3]}"
    changed = [
        key
        for key in set(startup_env) | set(request["env"])
        if key.startswith(START_UP_PREFIXES) and startup_env.get(key) != request["env"].get(key)
    ]
    return f"start-up environment differs: {sorted(changed)}" if changed else None


# --- the child ----------------------------------------------------------------------------------------


def run_child(request: dict, fds: list[int]) -> None:
    """Become ``python ARGV`` in the request's environment; exit as it would."""
    os.setpgid(0, 0)
    own_exit_hooks()
    for target, fd in zip((0, 1, 2), fds):
        if fd != target:
            os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    unbuffered = argv[0] == "-u" or bool(os.environ.get("PYTHONUNBUFFERED"))
    argv = argv[1:] if argv[0] == "-u" else argv
    fresh_stdio(unbuffered)
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    os._exit(exit_code(lambda: run_main(argv)))


def run_main(argv: list[str]) -> None:
    if argv[0] == "-m":
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def exit_code(main) -> int:
    """Run ``main`` and shut down as the interpreter would -> the exit code."""
    code = 0
    try:
        main()
    except SystemExit as exit:
        code = system_exit_code(exit.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # non-daemon threads, as at interpreter exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:  # as CPython reports an unhandled KeyboardInterrupt: killed by SIGINT
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def system_exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


def fresh_stdio(unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr on fds 0-2 as a new interpreter makes them (the server's stay referenced,
    so collecting them does not close the fds)."""
    _old_streams.extend((sys.stdin, sys.stdout, sys.stderr))
    encoding = sys.stdout.encoding if sys.stdout is not None else "utf-8"

    def writer(fd: int, errors: str, line_buffering: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        binary = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(binary, encoding, errors, line_buffering=line_buffering, write_through=unbuffered)

    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding)
    sys.stdout = sys.__stdout__ = writer(1, "strict", not unbuffered and os.isatty(1))
    sys.stderr = sys.__stderr__ = writer(2, "backslashreplace", not unbuffered)


_old_streams: list = []

if __name__ == "__main__":
    serve(sys.argv[1])
