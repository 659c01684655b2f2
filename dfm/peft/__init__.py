"""LoRA fine-tuning: adapters on megatron's parallel linears, named in diffusers' vocabulary (docs/lora.md)."""
