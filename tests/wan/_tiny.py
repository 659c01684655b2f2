"""A tiny random diffusers Wan 2.1 T2V transformer and its dfm config, built by the tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dfm.config.container import ModelConfig
from dfm.convert.wan import model_overrides

TEXT_LEN = 8  # text padded per sample, as WanPipeline pads to 512
TINY = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=4,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=24,
    freq_dim=256,
    ffn_dim=64,
    num_layers=2,
)

# Wan2.2-TI2V-5B's shape in small: 48 latent channels (the Wan 2.2 VAE's z_dim).
TINY_TI2V = {**TINY, "in_channels": 48, "out_channels": 48}
# I2V-A14B in small: 4 latent channels in, 4 + 4 mask + 4 image-latent channels read (as 16 + 4 + 16 = 36).
TINY_I2V = {**TINY, "in_channels": 12, "out_channels": 4}


def tiny_diffusers_wan(seed: int = 0, std: float = 0.1, config: dict = TINY):
    """WanTransformer3DModel with every parameter N(0, std^2) (zero or one inits would hide bugs), fp32."""
    import diffusers

    from tests._parity import random_model

    return random_model(lambda: diffusers.WanTransformer3DModel(**config).float(), seed, std)


def tiny_model_config(config: dict = TINY, **overrides) -> ModelConfig:
    fields = {
        key.split(".", 1)[1]: value for key, value in model_overrides(dict(config)).items() if key.startswith("model.")
    }
    return ModelConfig(
        **{**fields, "architecture": "wan", "max_text_len": TEXT_LEN, "attention_backend": "sdpa", **overrides}
    )


def tiny_wan_pipeline_folder(root) -> None:
    """What data preparation reads of a Wan2.1-T2V-*-Diffusers folder, tiny and random: tokenizer/ and
    text_encoder/ (UMT5, 24-d like TINY's text_dim), vae/ (AutoencoderKLWan, 4 latent channels)."""
    from pathlib import Path

    from transformers import ByT5Tokenizer, UMT5Config, UMT5EncoderModel

    from dfm.data.encoders.tiny import build_tiny_wan_vae

    root = Path(root)
    torch.manual_seed(0)
    config = UMT5Config(vocab_size=384, d_model=TINY["text_dim"], d_kv=6, d_ff=32, num_layers=2, num_heads=4)
    UMT5EncoderModel(config).save_pretrained(root / "text_encoder")
    ByT5Tokenizer().save_pretrained(root / "tokenizer")
    build_tiny_wan_vae(root / "vae", 0, TINY["in_channels"])


def write_tiny_videos(folder) -> None:
    """Two captioned clips of 5 frames (1 + 4k for the Wan VAE), 32 x 48, with sidecar captions."""
    import json
    from pathlib import Path

    import imageio.v3 as iio

    folder = Path(folder)
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    for name, caption in (("bars", "stripes sliding to the left"), ("dots", "a dot moving up")):
        frames = (torch.rand(5, 32, 48, 3, generator=gen) * 255).to(torch.uint8).numpy()
        iio.imwrite(folder / f"{name}.mp4", frames, fps=8)
        (folder / f"{name}.json").write_text(json.dumps({"caption": caption}))


def tiny_wan_pair(config: dict = TINY, **overrides):
    """(the tiny random diffusers Wan of ``config``, the dfm Wan holding its weights, its ModelConfig);
    needs the process group."""
    transformer = tiny_diffusers_wan(config=config)
    cfg = tiny_model_config(config, **overrides)
    return transformer, dfm_wan_of(transformer, cfg), cfg


@dataclass
class DiffusersReference:
    """diffusers on each sample alone and one backward of sum_i <out_i, g_i>."""

    outputs: list[torch.Tensor]  # per sample [C, T, H, W], detached
    upstream: list[torch.Tensor]  # the g_i, random
    grads: dict[str, torch.Tensor]  # {diffusers name: gradient}


def diffusers_reference(transformer, samples, timesteps, seed: int = 7) -> DiffusersReference:
    """``transformer`` run on each of ``samples`` alone (its timestep of ``timesteps``, text padded to
    TEXT_LEN), then one backward with random upstream gradients drawn from ``seed``."""
    from dfm.convert.wan import diffusers_sample_output

    gen = torch.Generator().manual_seed(seed)
    upstream = [torch.randn(s.latent_shape, generator=gen) for s in samples]
    transformer.zero_grad(set_to_none=True)
    outputs = [diffusers_sample_output(transformer, s, t, TEXT_LEN) for s, t in zip(samples, timesteps)]
    sum((out * g).sum() for out, g in zip(outputs, upstream)).backward()
    grads = {name: p.grad for name, p in transformer.named_parameters()}
    return DiffusersReference([out.detach() for out in outputs], upstream, grads)


def parity_errors(model, cfg: ModelConfig, batch, timesteps, reference: DiffusersReference):
    """(max abs diff of the pack's per-sample outputs, {diffusers name: max abs gradient diff / max abs
    diffusers gradient}) of the one-process dfm ``model`` against ``reference``, same backward."""
    from dfm.convert.rules import to_diffusers
    from dfm.convert.wan import dfm_sample_outputs, max_abs_diff, rules

    model.zero_grad(set_to_none=True)
    outputs = dfm_sample_outputs(model(batch.latents, timesteps, batch), batch, cfg)
    sum((out * g).sum() for out, g in zip(outputs, reference.upstream)).backward()
    grads = to_diffusers({name: p.grad for name, p in model.named_parameters()}, rules(cfg))
    errors = {
        name: ((grads[name] - expected).abs().max() / expected.abs().max()).item()
        for name, expected in reference.grads.items()
    }
    return max_abs_diff([out.detach() for out in outputs], reference.outputs), errors


def dfm_wan_of(transformer, cfg: ModelConfig, precision: str = "fp32"):
    """The dfm Wan of ``cfg`` (built for ``precision``) holding ``transformer``'s weights (eval); needs
    the process group."""
    from dfm.convert.rules import to_dfm
    from dfm.convert.wan import rules
    from dfm.convert.weights import fill_weights
    from dfm.models.build import build_model

    model, _ = build_model(cfg, precision)
    fill_weights(model, to_dfm(transformer.state_dict(), rules(cfg)), "a tiny diffusers Wan")
    return model.eval()
