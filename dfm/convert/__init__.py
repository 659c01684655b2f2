"""Published models (diffusers folders) <-> dfm checkpoints: shared rules, folders, checkpoints and CLI."""
