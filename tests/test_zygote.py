"""The tests' import server (tests/zygote.py): a script run through it is what ``python script`` would be,
with torch already imported: its argv, working directory, environment, stdio, exit status and stop
signals; requests it cannot serve exactly run as plain processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.zygote import checkout_env, python_args

SCRIPT = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "probe": os.environ.get("ZYGOTE_PROBE"),
                  "torch_loaded": "torch" in sys.modules, "path0": sys.path[0], "main": __name__, "pid": os.getpid()}))
print("to stderr", file=sys.stderr)
action = sys.argv[1]
if action == "exit":
    sys.exit(int(sys.argv[2]))
if action == "raise":
    raise ValueError("a named failure")
if action == "kill":
    os.kill(os.getpid(), int(sys.argv[2]))
if action == "media":  # wandb's temporary folder, made when the server imported wandb
    from wandb.sdk.data_types._private import MEDIA_TMP
    print(MEDIA_TMP.name, os.path.isdir(MEDIA_TMP.name))
if action == "env":
    print(sorted(os.environ))
if action == "sleep":
    import signal, time
    signal.signal(signal.SIGTERM, lambda *_: (print("stopping", flush=True), sys.exit(3)))
    print("ready", flush=True)
    time.sleep(60)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return path


def run(args: list, cwd, extra_env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    env = checkout_env({**os.environ, "OMP_NUM_THREADS": "1", "ZYGOTE_PROBE": "seen", **(extra_env or {})})
    return subprocess.run(
        [sys.executable, *python_args(), *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, **kwargs
    )


def report(result: subprocess.CompletedProcess) -> dict:
    import json

    return json.loads(result.stdout.splitlines()[0])


def test_a_script_runs_as_its_own_main_with_argv_cwd_env_and_stdio(script, tmp_path):
    assert python_args(), "the server did not start"
    result = run([script, "exit", "0"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    seen = report(result)
    assert seen["argv"] == [str(script), "exit", "0"]
    assert seen["cwd"] == str(tmp_path) and seen["probe"] == "seen" and seen["main"] == "__main__"
    assert seen["path0"] == str(script.parent)
    assert seen["torch_loaded"]  # forked from the server, not a fresh interpreter
    assert result.stderr.strip().endswith("to stderr")


def test_exit_codes_exceptions_and_deaths_by_signal_are_the_scripts(script, tmp_path):
    assert run([script, "exit", "7"], cwd=tmp_path).returncode == 7
    failed = run([script, "raise"], cwd=tmp_path)
    assert failed.returncode == 1 and "ValueError: a named failure" in failed.stderr
    assert run([script, "kill", str(int(signal.SIGKILL))], cwd=tmp_path).returncode == -signal.SIGKILL


def test_a_module_runs_with_dash_m(tmp_path):
    (tmp_path / "probe_module.py").write_text(SCRIPT)
    result = run(["-m", "probe_module", "exit", "0"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert report(result)["path0"] == str(tmp_path) and report(result)["main"] == "__main__"


def test_stop_signals_reach_the_script_and_killing_the_client_ends_it(script, tmp_path):
    env = checkout_env({**os.environ, "OMP_NUM_THREADS": "1"})
    command = [sys.executable, *python_args(), str(script), "sleep"]
    for stop in (signal.SIGTERM, signal.SIGKILL):
        process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
        child = report(subprocess.CompletedProcess([], 0, process.stdout.readline()))
        assert child["torch_loaded"]
        assert process.stdout.readline().strip() == "ready"
        pid = child["pid"]
        assert pid != process.pid
        process.send_signal(stop)
        process.wait(timeout=30)
        if stop == signal.SIGTERM:  # forwarded: the script's handler ran and chose the exit code
            assert process.returncode == 3 and process.stdout.read().strip() == "stopping"
        deadline = time.monotonic() + 30
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid)


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_start_up_setting_the_server_lacks_runs_a_plain_process(script, tmp_path):
    result = run([script, "exit", "0"], cwd=tmp_path, extra_env={"OMP_NUM_THREADS": "2"})
    assert result.returncode == 0, result.stderr
    assert not report(result)["torch_loaded"]


def test_the_servers_temporary_folders_outlive_each_child(script, tmp_path):
    """wandb makes its media folder when imported (in the server); a child's exit must not remove it."""
    for _ in range(2):
        result = run([script, "media"], cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines()[1].endswith(" True"), result.stdout


def test_a_broken_request_leaves_the_server_serving(script, tmp_path):
    import socket

    path = python_args()[-1]
    for payload in (b"", b"\x00\x00\x00\x00\x00\x00\x00\x05{bad", b"\x00\x00\x00\x00\x00\x00\x01\x00{"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(path)
            client.sendall(payload)  # then hang up (mid-message for the last one)
    result = run([script, "exit", "0"], cwd=tmp_path)
    assert result.returncode == 0 and report(result)["torch_loaded"], result.stderr


def test_a_pid_and_a_status_in_one_read_are_two_replies():
    """A child that exits at once has its status sent right behind its pid: the client reads them as two
    lines even when one read brings both (before: 'Extra data' from json, the test run failed)."""
    import socket

    from tests.zygote_client import read_reply

    server, client = socket.socketpair()
    with server, client:
        server.sendall(b'{"pid": 12345}\n{"status": 256}\n')
        replies = client.makefile("rb")
        assert read_reply(replies) == {"pid": 12345}
        assert read_reply(replies) == {"status": 256}
        server.close()
        with pytest.raises(ConnectionError):
            read_reply(replies)


@pytest.mark.parametrize("poisoned", [False, True])
def test_the_server_knows_whether_its_forks_could_use_cuda(monkeypatch, poisoned):
    """On a GPU machine an import that asked the CUDA runtime for its devices marks every fork unable to use
    CUDA (the training smoke tests failed so on an H200, 2026-11-29): the server then serves no one, and
    each script runs as a plain process."""
    import torch

    from tests.zygote import forked_children_can_use_cuda

    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: poisoned)
    assert forked_children_can_use_cuda() is not poisoned


def test_the_server_asks_nvml_for_devices_while_importing_only(script, tmp_path):
    result = run([script, "env"], cwd=tmp_path)
    assert result.returncode == 0 and report(result)["torch_loaded"], result.stderr
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in result.stdout
