"""Wan 2.1 text-to-video: diffusers ``WanTransformer3DModel`` <-> dfm ``model.architecture=wan``.

The rule table names every tensor; the parity helpers run diffusers and dfm on the same packed
samples (``verify`` for the CLI's ``--verify``, and the tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor

from dfm.config.container import ConfigContainer, ModelConfig
from dfm.convert.diffusers_model import diffusers_outputs_alone
from dfm.convert.family import Family
from dfm.convert.rules import ConversionError, Rule, fused_kv, fused_qkv, rename
from dfm.convert.weights import converted_model
from dfm.data.packed_batch import PackedBatch
from dfm.data.packing import pack_samples
from dfm.data.patchify import patchify, unpatchify
from dfm.data.sample import DiffusionSample
from dfm.data.video_condition import WAN_MASK_CHANNELS, wan_condition_channels, wan_image_condition
from dfm.diffusion.timestep_experts import BOTH
from dfm.inference.checkpoint_loading import single_process_config

FREQ_DIM = 256  # the timestep sinusoid width of every published Wan (dfm's TimestepEmbedder)
QK_NORM = "rms_norm_across_heads"


def _refuse(config: dict, key: str, expected) -> None:
    if config.get(key, expected) != expected:
        raise ConversionError(f"config.json {key}={config[key]!r}: dfm's Wan supports {expected!r} (Wan 2.1 T2V)")


def model_overrides(config: dict) -> dict:
    """diffusers config.json -> dfm model keys. Image conditioning (I2V) is refused."""
    for key, expected in (
        ("image_dim", None),
        ("added_kv_proj_dim", None),
        ("pos_embed_seq_len", None),
        ("qk_norm", QK_NORM),
        ("cross_attn_norm", True),
        ("freq_dim", FREQ_DIM),
    ):
        _refuse(config, key, expected)
    pt, ph, pw = config.get("patch_size", (1, 2, 2))
    if ph != pw:
        raise ConversionError(f"config.json patch_size={[pt, ph, pw]}: dfm needs equal spatial patch sides")
    heads, head_dim = config.get("num_attention_heads", 40), config.get("attention_head_dim", 128)
    in_channels, out_channels = config.get("in_channels", 16), config.get("out_channels")
    # Wan 2.2 I2V: the input is the latent, 4 mask and the image latent's channels (2 out + 4).
    image_condition = out_channels is not None and in_channels == 2 * out_channels + WAN_MASK_CHANNELS
    if out_channels not in (None, in_channels) and not image_condition:
        raise ConversionError(
            f"config.json in_channels={in_channels}, out_channels={out_channels}: dfm's Wan reads "
            "in_channels = out_channels, or 2 out_channels + 4 (image-to-video: latent, mask, image latent)"
        )
    if image_condition:
        in_channels = out_channels
    return {
        "model.num_layers": config.get("num_layers", 40),
        "model.hidden_size": heads * head_dim,
        "model.num_attention_heads": heads,
        "model.ffn_hidden_size": config.get("ffn_dim", 13824),
        "model.in_channels": in_channels,
        "model.out_channels": out_channels or in_channels,
        "model.wan_image_condition": image_condition,
        "model.patch_temporal": pt,
        "model.patch_spatial": ph,
        "model.text_embed_dim": config.get("text_dim", 4096),
        "model.layernorm_epsilon": config.get("eps", 1e-6),
        "model.pos_embedding": "rope3d",
        "model.qk_layernorm": True,
        "model.pipeline": "flow",
        "flow.c_noise_scale": 1000.0,  # Wan embeds the timestep 1000 t
    }


def diffusers_config(model: ModelConfig) -> dict:
    """The config.json of an exported dfm Wan."""
    return {
        "patch_size": [model.patch_temporal, model.patch_spatial, model.patch_spatial],
        "num_attention_heads": model.num_attention_heads,
        "attention_head_dim": model.hidden_size // model.num_attention_heads,
        "in_channels": model.in_channels + wan_condition_channels(model),
        "out_channels": model.out_channels or model.in_channels,
        "text_dim": model.text_embed_dim,
        "freq_dim": FREQ_DIM,
        "ffn_dim": model.effective_ffn_hidden_size,
        "num_layers": model.num_layers,
        "cross_attn_norm": True,
        "qk_norm": QK_NORM,
        "eps": model.layernorm_epsilon,
        "image_dim": None,
        "added_kv_proj_dim": None,
        "rope_max_seq_len": 1024,
        "pos_embed_seq_len": None,
    }


def patch_embedding_rule(model: ModelConfig) -> Rule:
    """Conv3d weight [h, c, pt, ph, pw] <-> dfm's Linear [h, pt*ph*pw*c] (token features (pt, ph, pw, c);
    I2V: c counts the image condition's channels too, after the latent's, as diffusers' input)."""
    pt, ps, c = model.patch_temporal, model.patch_spatial, model.in_channels + wan_condition_channels(model)

    def join(tensors: list[Tensor]) -> Tensor:
        return tensors[0].permute(0, 2, 3, 4, 1).reshape(tensors[0].shape[0], -1).contiguous()

    def split(tensor: Tensor) -> list[Tensor]:
        return [tensor.reshape(tensor.shape[0], pt, ps, ps, c).permute(0, 4, 1, 2, 3).contiguous()]

    return Rule("x_embedder.weight", ("patch_embedding.weight",), join=join, split=split)


def _linear(dfm: str, diffusers: str) -> list[Rule]:
    return [rename(f"{dfm}.{kind}", f"{diffusers}.{kind}") for kind in ("weight", "bias")]


def block_rules(i: int, heads: int) -> list[Rule]:
    d, b = f"layers.{i}", f"blocks.{i}"
    qkv = [
        fused_qkv(
            f"{d}.self_attention.linear_qkv.{kind}", *(f"{b}.attn1.to_{x}.{kind}" for x in "qkv"), num_heads=heads
        )
        for kind in ("weight", "bias")
    ]
    kv = [
        fused_kv(f"{d}.cross_attention.linear_kv.{kind}", *(f"{b}.attn2.to_{x}.{kind}" for x in "kv"), num_heads=heads)
        for kind in ("weight", "bias")
    ]
    norms = [
        rename(f"{d}.{attention}.{x}_layernorm.weight", f"{b}.{attn}.norm_{x}.weight")
        for attention, attn in (("self_attention", "attn1"), ("cross_attention", "attn2"))
        for x in "qk"
    ]
    return [
        rename(f"{d}.adaln.scale_shift_table", f"{b}.scale_shift_table"),
        *qkv,
        *_linear(f"{d}.self_attention.linear_proj", f"{b}.attn1.to_out.0"),
        *_linear(f"{d}.cross_attention.linear_q", f"{b}.attn2.to_q"),
        *kv,
        *_linear(f"{d}.cross_attention.linear_proj", f"{b}.attn2.to_out.0"),
        *norms,
        *_linear(f"{d}.norm2", f"{b}.norm2"),
        *_linear(f"{d}.mlp.linear_fc1", f"{b}.ffn.net.0.proj"),
        *_linear(f"{d}.mlp.linear_fc2", f"{b}.ffn.net.2"),
    ]


def rules(model: ModelConfig) -> list[Rule]:
    """Every dfm Wan parameter and the diffusers tensors it is made of."""
    embedder = "condition_embedder"
    return [
        patch_embedding_rule(model),
        rename("x_embedder.bias", "patch_embedding.bias"),
        *_linear("t_embedder.mlp.0", f"{embedder}.time_embedder.linear_1"),
        *_linear("t_embedder.mlp.2", f"{embedder}.time_embedder.linear_2"),
        *_linear("time_proj", f"{embedder}.time_proj"),
        *_linear("text_embedder.mlp.0", f"{embedder}.text_embedder.linear_1"),
        *_linear("text_embedder.mlp.2", f"{embedder}.text_embedder.linear_2"),
        *(rule for i in range(model.num_layers) for rule in block_rules(i, model.num_attention_heads)),
        rename("final_layer.scale_shift_table", "scale_shift_table"),
        *_linear("final_layer.linear", "proj_out"),
    ]


# --- parity: dfm against diffusers on the same samples ------------------------------------------------

# (latent (T, H, W), text tokens) of the parity samples: different shapes in one pack.
PARITY_SHAPES = (((3, 4, 6), 5), ((1, 6, 4), 3), ((2, 4, 4), 4))


def parity_samples(
    model: ModelConfig, shapes=PARITY_SHAPES, seed: int = 0, first_frame_clean: Sequence[bool] = ()
) -> list[DiffusionSample]:
    """Random latents and text (fewer tokens than model.max_text_len) of the given shapes; the
    samples flagged in ``first_frame_clean`` (by position) are TI2V ones (a clean first frame)."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for index, ((t, h, w), text_len) in enumerate(shapes):
        thw = (t * model.patch_temporal, h * model.patch_spatial, w * model.patch_spatial)
        latent = torch.randn((model.in_channels, *thw), generator=gen)
        tokens, pos_ids = patchify(latent, model.patch_temporal, model.patch_spatial)
        text = torch.randn((min(text_len, model.max_text_len), model.text_embed_dim), generator=gen)
        sample = DiffusionSample(tokens, pos_ids, text, tuple(latent.shape), index)
        sample.first_frame_clean = index < len(first_frame_clean) and first_frame_clean[index]
        if model.wan_image_condition:  # I2V: a random image-condition latent
            image = torch.randn(latent.shape, generator=gen)
            sample.image_condition = wan_image_condition(image, model.patch_temporal, model.patch_spatial)
        samples.append(sample)
    return samples


def parity_timesteps(num_samples: int, seed: int = 0) -> Tensor:
    """[N] Wan timesteps (1000 t)."""
    return 1000 * torch.rand(num_samples, generator=torch.Generator().manual_seed(seed + 1))


def diffusers_timestep(sample: DiffusionSample, timestep: Tensor, pt: int, ps: int) -> Tensor:
    """[1] for a text-to-video sample; [1, L] for a TI2V one: diffusers' ``expand_timesteps``, the
    timestep per token of its (frame, row, column) grid, 0 on the first frame."""
    if not sample.first_frame_clean:
        return timestep.reshape(1)
    _, t, h, w = sample.latent_shape
    per_token = torch.full((t // pt, h // ps, w // ps), float(timestep))
    per_token[0] = 0
    return per_token.flatten()[None]


def diffusers_sample_output(transformer, sample: DiffusionSample, timestep: Tensor, text_len: int) -> Tensor:
    """diffusers on one sample alone, text zero-padded to ``text_len`` as WanPipeline does -> [C, T, H, W]."""
    pt, ps, _ = transformer.config.patch_size
    latent = unpatchify(sample.tokens, sample.latent_shape, pt, ps)
    text = sample.text.new_zeros(1, text_len, sample.text.shape[-1])  # on the sample's device and dtype
    text[0, : sample.text.shape[0]] = sample.text
    if sample.image_condition is not None:  # I2V: cat([latents, condition]) on channels, as the pipeline
        _, t, h, w = sample.latent_shape
        condition = unpatchify(
            sample.image_condition, (sample.image_condition.shape[1] // (pt * ps * ps), t, h, w), pt, ps
        )
        latent = torch.cat([latent, condition])
    out = transformer(latent[None], diffusers_timestep(sample, timestep, pt, ps), text, return_dict=False)[0]
    return out[0]


def dfm_sample_outputs(out: Tensor, batch: PackedBatch, model: ModelConfig) -> list[Tensor]:
    """dfm's packed output [S, D] -> each sample's [C, T, H, W]."""
    host = batch.host_view()
    starts, lengths = host.cu_seqlens_q_padded[:-1].tolist(), host.sample_lengths.tolist()
    return [
        unpatchify(out[start : start + n], tuple(shape), model.patch_temporal, model.patch_spatial)
        for start, n, shape in zip(starts, lengths, host.latent_shape.tolist())
    ]


def max_abs_diff(outputs: Sequence[Tensor], references: Sequence[Tensor]) -> float:
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(outputs, references))


@torch.no_grad()
def verify(folder: str, cfg: ConfigContainer, weights: Callable[[], Iterable[tuple[str, Tensor]]]) -> float:
    """Max abs diff of dfm (``weights()``: its (name, tensor) pairs, one process, fp32) vs diffusers
    (``folder``) on random packed samples. The two models run one after the other, never both in memory."""
    single = single_process_config(cfg)
    samples = parity_samples(single.model)
    batch, timesteps = pack_samples(samples), parity_timesteps(len(samples))

    def run(transformer) -> list[Tensor]:
        return [
            diffusers_sample_output(transformer, s, t, single.model.max_text_len) for s, t in zip(samples, timesteps)
        ]

    references = diffusers_outputs_alone(folder, "WanTransformer3DModel", run)
    with converted_model(single.model, weights(), cfg.rng.seed) as model:
        outputs = dfm_sample_outputs(model(batch.latents, timesteps, batch), batch, single.model)
    return max_abs_diff(outputs, references)


WAN = Family(
    architecture="wan",
    diffusers_class="WanTransformer3DModel",
    model_overrides=model_overrides,
    diffusers_config=diffusers_config,
    rules=rules,
    verify=verify,
)


# --- Wan 2.2 A14B's two experts (the folders: dfm/convert/wan_experts.py) ------------------------------

# Each expert's transformer folder in a two-expert pipeline folder.
EXPERT_FOLDERS = {"high_noise": "transformer", "low_noise": "transformer_2"}


def expert_weights(weights: dict, expert: str) -> dict:
    """{name in the expert: tensor} of the ``expert.*`` entries of a both-run's ``weights``."""
    prefix = f"{expert}."
    return {name[len(prefix) :]: value for name, value in weights.items() if name.startswith(prefix)}


def expert_lora_files(expert: str, weights: dict) -> list[tuple[str, dict, str]]:
    """``export-lora`` of a run of ``expert`` (high_noise, low_noise, both): (subfolder, its model's
    weights, the call that loads it). diffusers' Wan loader reads a file's ``transformer.*`` keys
    into ``transformer``, or with ``load_into_transformer_2=True`` into ``transformer_2``: each
    expert's adapters are one such file, a both-run's in ``transformer/`` and ``transformer_2/``."""
    into = {"high_noise": 'pipeline.load_lora_weights("{}")'}
    into["low_noise"] = 'pipeline.load_lora_weights("{}", load_into_transformer_2=True)'
    if expert != BOTH:
        return [("", weights, into[expert])]
    return [(EXPERT_FOLDERS[name], expert_weights(weights, name), into[name]) for name in EXPERT_FOLDERS]
