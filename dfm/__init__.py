"""dfm: diffusion transformers on megatron-core, from one CPU to many GPUs."""

from dfm.platform.import_cost import defer_megatron_compile

defer_megatron_compile()  # before anything imports megatron-core: see dfm/platform/import_cost.py
