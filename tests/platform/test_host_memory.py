"""glibc's thresholds fixed on CPU hosts (dfm/platform/host_memory.py): a freed tensor of a block's
size goes back to the system, a small one is reused without faulting its pages in again, unless the
user set malloc's thresholds themselves."""

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


# Page faults of 200 activations of 1 MiB (written, then freed), after a warm-up: a mapping per
# tensor faults each one's 256 pages in again.
FAULTS_OF_SMALL_TENSORS = """
import resource, sys, torch
from dfm.platform.host_memory import return_freed_memory_promptly
assert return_freed_memory_promptly(*[int(x) for x in sys.argv[1:]])
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    torch.ones(1 << 18)
before = faults()
for _ in range(200):
    torch.ones(1 << 18)
print(faults() - before)
"""


@pytest.mark.skipif(host_memory._glibc() is None, reason="glibc only")
def test_small_tensors_reuse_the_heap_instead_of_faulting_in_new_pages():
    def faults(*thresholds: int) -> int:
        args = [sys.executable, "-c", FAULTS_OF_SMALL_TENSORS, *map(str, thresholds)]
        return int(subprocess.run(args, capture_output=True, text=True, check=True).stdout.split()[-1])

    assert faults() < 200  # dfm's thresholds: the 1 MiB comes from the heap, pages kept
    assert faults(128 << 10, 128 << 10) > 200 * 200  # a mapping per tensor: ~256 faults each


@pytest.mark.skipif(host_memory._glibc() is None, reason="glibc only")
@pytest.mark.parametrize("setting, kept_mib", [("default", (15, 25)), ("fixed", (-1, 2))])
def test_freed_block_sized_tensor_is_returned_with_the_fixed_threshold(setting, kept_mib):
    out = subprocess.run([sys.executable, "-c", KEPT_AFTER_FREE, setting], capture_output=True, text=True, check=True)
    low, high = kept_mib
    assert low <= float(out.stdout.strip().splitlines()[-1]) <= high


def test_a_users_malloc_setting_is_kept(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4194304")
    assert host_memory.return_freed_memory_promptly() is False
