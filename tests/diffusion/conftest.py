import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only contend (40x slower on a busy 2-core runner)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
