"""dfm: diffusion transformers on megatron-core, from one CPU to many GPUs."""

from dfm.platform.import_cost import defer_start_up_imports

defer_start_up_imports()  # before anything imports megatron-core: see dfm/platform/import_cost.py
