"""HunyuanVideo 1.5: diffusers ``HunyuanVideo15Transformer3DModel`` <-> dfm ``model.architecture=hunyuan_video15``.

The dual-stream blocks convert as FLUX's double-stream blocks (dfm/convert/flux.py). Beyond names:
the 1x1x1 patch embedding is a Conv3d in diffusers and a Linear here, q/k/v are fused per stream,
and the final adaLN chunks are (shift, scale) in dfm, (scale, shift) in diffusers. dfm's
``in_channels`` is the latent width C; diffusers' is 2C + 1 (latents, condition latents, mask).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from dfm.config.container import ConfigContainer, ModelConfig
from dfm.convert.diffusers_model import diffusers_outputs_alone
from dfm.convert.family import Family
from dfm.convert.flux import _double_block, _linear, per_sample_max_abs_diff, swapped_halves
from dfm.convert.rules import ConversionError, Rule, rename
from dfm.convert.weights import converted_model
from dfm.data.packed_batch import PackedBatch
from dfm.data.packing import pack_samples
from dfm.data.patchify import patchify, unpatchify
from dfm.data.sample import DiffusionSample
from dfm.data.video_condition import condition_of
from dfm.inference.checkpoint_loading import single_process_config

DIFFUSERS_CLASS = "HunyuanVideo15Transformer3DModel"


def patch_embedding_rule() -> Rule:
    """Conv3d weight [h, 2C+1, 1, 1, 1] <-> Linear [h, 2C+1]."""
    return Rule(
        "x_embedder.weight",
        ("x_embedder.proj.weight",),
        join=lambda t: t[0].reshape(t[0].shape[0], -1).contiguous(),
        split=lambda t: [t.reshape(*t.shape, 1, 1, 1).contiguous()],
    )


def _sequential(dfm: str, diffusers: str, names: dict[int, str]) -> list[Rule]:
    """An nn.Sequential's weighted layers (index -> diffusers module name)."""
    return [rule for index, name in names.items() for rule in _linear(f"{dfm}.{index}", f"{diffusers}.{name}")]


def _refiner_block(i: int) -> list[Rule]:
    d, b = f"refiner.blocks.{i}", f"context_embedder.token_refiner.refiner_blocks.{i}"
    pairs = [("norm1", "norm1"), ("norm2", "norm2"), ("adaln", "norm_out.linear"), ("linear_proj", "attn.to_out.0")]
    pairs += [(f"linear_{x}", f"attn.to_{x}") for x in "qkv"] + [("mlp.0", "ff.net.0.proj"), ("mlp.2", "ff.net.2")]
    return [rule for ours, theirs in pairs for rule in _linear(f"{d}.{ours}", f"{b}.{theirs}")]


def hunyuan_rules(model: ModelConfig) -> list[Rule]:
    """Every dfm HunyuanVideo 1.5 parameter and the diffusers tensor it is."""
    embed = "context_embedder.time_text_embed"
    rules = [
        patch_embedding_rule(),
        rename("x_embedder.bias", "x_embedder.proj.bias"),
        *_linear("t_embedder.mlp.0", "time_embed.timestep_embedder.linear_1"),
        *_linear("t_embedder.mlp.2", "time_embed.timestep_embedder.linear_2"),
        *_linear("refiner.t_embedder.mlp.0", f"{embed}.timestep_embedder.linear_1"),
        *_linear("refiner.t_embedder.mlp.2", f"{embed}.timestep_embedder.linear_2"),
        *_linear("refiner.pooled_embedder.0", f"{embed}.text_embedder.linear_1"),
        *_linear("refiner.pooled_embedder.2", f"{embed}.text_embedder.linear_2"),
        *_linear("refiner.proj_in", "context_embedder.proj_in"),
        *_sequential("byt5_embedder", "context_embedder_2", {0: "norm", 1: "linear_1", 3: "linear_2", 5: "linear_3"}),
        *_sequential("image_embedder", "image_embedder", {0: "norm_in", 1: "linear_1", 3: "linear_2", 4: "norm_out"}),
        rename("cond_type_embed.weight", "cond_type_embed.weight"),
        swapped_halves("final_layer.adaln.weight", "norm_out.linear.weight"),
        swapped_halves("final_layer.adaln.bias", "norm_out.linear.bias"),
        *_linear("final_layer.linear", "proj_out"),
    ]
    for i in range(model.num_refiner_layers):
        rules += _refiner_block(i)
    for i in range(model.num_layers):
        rules += _double_block(i, model.num_attention_heads)
    return rules


def _refuse(config: dict, key: str, expected) -> None:
    if config.get(key, expected) != expected:
        raise ConversionError(f"config.json {key}={config[key]!r}: dfm's HunyuanVideo 1.5 supports {expected!r}")


def model_overrides(config: dict) -> dict:
    """diffusers config.json -> dfm model keys."""
    for key, expected in (("patch_size", 1), ("patch_size_t", 1), ("qk_norm", "rms_norm"), ("use_meanflow", False)):
        _refuse(config, key, expected)
    out_channels = config.get("out_channels", 32)
    if config.get("in_channels", 65) != 2 * out_channels + 1:
        raise ConversionError(
            f"config.json in_channels={config['in_channels']}: dfm needs 2 x out_channels + 1 = {2 * out_channels + 1}"
            " (noisy latents, condition latents, mask)"
        )
    heads, head_dim = config.get("num_attention_heads", 16), config.get("attention_head_dim", 128)
    hidden = heads * head_dim
    return {
        "model.num_layers": config.get("num_layers", 54),
        "model.hidden_size": hidden,
        "model.num_attention_heads": heads,
        "model.ffn_hidden_size": int(config.get("mlp_ratio", 4.0) * hidden),
        "model.in_channels": out_channels,
        "model.out_channels": out_channels,
        "model.patch_spatial": 1,
        "model.patch_temporal": 1,
        "model.text_embed_dim": config.get("text_embed_dim", 3584),
        "model.text_embed_2_dim": config.get("text_embed_2_dim", 1472),
        "model.image_embed_dim": config.get("image_embed_dim", 1152),
        "model.num_refiner_layers": config.get("num_refiner_layers", 2),
        "model.rope_axes_dim": list(config.get("rope_axes_dim", (16, 56, 56))),
        "model.rope_theta": float(config.get("rope_theta", 256.0)),
        "model.qk_layernorm": True,
        "model.layernorm_epsilon": 1e-6,
        "model.pipeline": "flow",
        "flow.c_noise_scale": 1000.0,  # diffusers embeds the timestep 1000 t
    }


def diffusers_config(model: ModelConfig) -> dict:
    """The config.json of an exported dfm HunyuanVideo 1.5 (target_size / task_type: diffusers' defaults)."""
    return {
        "in_channels": 2 * model.in_channels + 1,
        "out_channels": model.out_channels or model.in_channels,
        "num_attention_heads": model.num_attention_heads,
        "attention_head_dim": model.hidden_size // model.num_attention_heads,
        "num_layers": model.num_layers,
        "num_refiner_layers": model.num_refiner_layers,
        "mlp_ratio": model.effective_ffn_hidden_size / model.hidden_size,
        "patch_size": 1,
        "patch_size_t": 1,
        "qk_norm": "rms_norm",
        "text_embed_dim": model.text_embed_dim,
        "text_embed_2_dim": model.text_embed_2_dim,
        "image_embed_dim": model.image_embed_dim,
        "rope_theta": model.rope_theta,
        "rope_axes_dim": list(model.rope_axes_dim),
    }


# --- parity: dfm against diffusers on the same samples ------------------------------------------------

# (latent (T, H, W), Qwen tokens, ByT5 tokens, image-to-video) of the parity clips: t2v and i2v mixed.
PARITY_CLIPS = (((3, 4, 6), 5, 3, True), ((2, 6, 4), 7, 2, False), ((1, 4, 4), 4, 4, True), ((2, 4, 5), 3, 1, False))
IMAGE_TOKENS = 5  # SigLIP tokens per image in the parity clips (729 in the published model)


def parity_samples(model: ModelConfig, clips=PARITY_CLIPS, seed: int = 0) -> list[DiffusionSample]:
    """Random clips, texts and image embeddings of the given shapes (t2v: image embeddings zero)."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for index, ((t, h, w), qwen_len, byt5_len, image_to_video) in enumerate(clips):
        latent = torch.randn((model.in_channels, t, h, w), generator=gen)
        tokens, pos_ids = patchify(latent, 1, 1)
        image = torch.randn((IMAGE_TOKENS, model.image_embed_dim), generator=gen)
        samples.append(
            DiffusionSample(
                tokens,
                pos_ids,
                torch.randn((qwen_len, model.text_embed_dim), generator=gen),
                tuple(latent.shape),
                index,
                condition=patchify(condition_of(latent, image_to_video), 1, 1)[0],
                text_2=torch.randn((byt5_len, model.text_embed_2_dim), generator=gen),
                image_embeds=image if image_to_video else torch.zeros_like(image),
            )
        )
    return samples


def verification_pack(model: ModelConfig, seed: int = 0, padding: tuple[int, int] = (1, 1)):
    """(pack, c_noise [N]): the parity clips packed with the layout's ``padding`` (segment, total) multiples."""
    samples = parity_samples(model, seed=seed)
    c_noise = 1000 * torch.rand(len(samples), generator=torch.Generator().manual_seed(seed + 1))
    return pack_samples(samples, *padding), c_noise


def diffusers_inputs(batch: PackedBatch, x_in: Tensor, c_noise: Tensor, sample: int) -> dict:
    """Sample ``sample`` of a pack as HunyuanVideo15Transformer3DModel's keyword arguments (batch of one)."""
    host = batch.host_view()
    q0, k0, b0 = (
        int(host_cu[sample])
        for host_cu in (host.cu_seqlens_q_padded, host.cu_seqlens_kv_padded, host.cu_seqlens_kv2_padded)
    )
    n, k, b = (
        int(lengths[sample])
        for lengths in (host.sample_lengths, host.text_lengths, host.cu_seqlens_kv2[1:] - host.cu_seqlens_kv2[:-1])
    )
    shape = tuple(host.latent_shape[sample].tolist())
    tokens = torch.cat([x_in[q0 : q0 + n], batch.condition[q0 : q0 + n].to(x_in.dtype)], dim=-1)
    latent = unpatchify(tokens, (tokens.shape[1], *shape[1:]), 1, 1)
    return dict(
        hidden_states=latent[None],
        timestep=c_noise[sample : sample + 1],
        encoder_hidden_states=batch.context[None, k0 : k0 + k],
        encoder_attention_mask=torch.ones(1, k),
        encoder_hidden_states_2=batch.context_2[None, b0 : b0 + b],
        encoder_attention_mask_2=torch.ones(1, b),
        image_embeds=batch.image_embeds[sample : sample + 1],
    )


def diffusers_outputs(diffusers_model, batch: PackedBatch, c_noise: Tensor) -> list[Tensor]:
    """Each sample of ``batch`` run alone through diffusers -> its output tokens [L_i, C]."""
    with torch.no_grad():
        return [
            patchify(diffusers_model(**diffusers_inputs(batch, batch.latents, c_noise, i)).sample[0], 1, 1)[0]
            for i in range(batch.num_samples)
        ]


def verify(folder: str, cfg: ConfigContainer, weights: Callable[[], Iterable[tuple[str, Tensor]]]) -> float:
    """Max abs diff of dfm (``weights()``: its (name, tensor) pairs) vs diffusers (the model or pipeline
    folder ``folder``) on ``verification_pack`` (fp32, one process); the two models run one after the other."""
    model_cfg = single_process_config(cfg).model
    batch, c_noise = verification_pack(model_cfg)
    references = diffusers_outputs_alone(
        folder, DIFFUSERS_CLASS, lambda model: diffusers_outputs(model, batch, c_noise)
    )
    with converted_model(model_cfg, weights(), cfg.rng.seed) as model:
        packed = model(batch.latents, c_noise, batch)
    return max(per_sample_max_abs_diff(packed, references, batch))


HUNYUAN = Family(
    architecture="hunyuan_video15",
    diffusers_class=DIFFUSERS_CLASS,
    model_overrides=model_overrides,
    diffusers_config=diffusers_config,
    rules=hunyuan_rules,
    verify=verify,
)
