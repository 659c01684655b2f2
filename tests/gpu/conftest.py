from tests.models.conftest import dist  # noqa: F401  (the one-process megatron state fixture)
