"""glibc's mmap threshold fixed on CPU hosts (dfm/platform/host_memory.py): a freed tensor of a
block's size goes back to the system, unless the user set malloc's threshold themselves."""

import subprocess
import sys

import pytest

from dfm.platform import host_memory

# A freed 20 MiB tensor after a 24 MiB one was freed (which raises glibc's dynamic threshold to
# 24 MiB): RSS growth that stays, in MiB.
KEPT_AFTER_FREE = """
import sys, torch
from pathlib import Path
from dfm.platform.host_memory import return_freed_memory_promptly
if sys.argv[1] == "fixed":
    assert return_freed_memory_promptly()
def rss():
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024
x = torch.ones(6 << 20)
del x
before = rss()
x = torch.ones(5 << 20)
del x
print(rss() - before)
"""


@pytest.mark.skipif(host_memory._glibc() is None, reason="glibc only")
@pytest.mark.parametrize("setting, kept_mib", [("default", (15, 25)), ("fixed", (-1, 2))])
def test_freed_block_sized_tensor_is_returned_with_the_fixed_threshold(setting, kept_mib):
    out = subprocess.run([sys.executable, "-c", KEPT_AFTER_FREE, setting], capture_output=True, text=True, check=True)
    low, high = kept_mib
    assert low <= float(out.stdout.strip().splitlines()[-1]) <= high


def test_a_users_malloc_setting_is_kept(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4194304")
    assert host_memory.return_freed_memory_promptly() is False
