import pytest

from dfm.platform.distributed import destroy_distributed, initialize_distributed


@pytest.fixture(scope="module")
def dist():
    """A one-process megatron parallel_state (gloo on CPU) for the tests of one module."""
    initialize_distributed()
    yield
    destroy_distributed()
