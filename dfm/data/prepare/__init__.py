"""Raw images/videos + captions -> DFM-compatible webdataset shards of VAE latents and T5 embeddings."""
