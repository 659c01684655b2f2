"""FLUX.1: diffusers ``FluxTransformer2DModel`` <-> dfm ``model.architecture=flux``.

dfm's blocks ``layers.0 .. layers.{D-1}`` are diffusers' ``transformer_blocks`` (double stream),
``layers.{D} ..`` its ``single_transformer_blocks``. Two layouts differ beyond names: q/k/v are one
fused megatron projection per stream, and a token's patch features are (ph, pw, c) in dfm
(dfm/data/patchify.py) but (c, ph, pw) in diffusers (``FluxPipeline._pack_latents``); the final
adaLN chunks are (shift, scale) in dfm, (scale, shift) in diffusers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
from torch import Tensor

from dfm.config.container import ConfigContainer, ModelConfig
from dfm.convert.diffusers_model import diffusers_outputs_alone
from dfm.convert.family import Family
from dfm.convert.rules import ConversionError, Rule, fused_qkv, rename
from dfm.convert.weights import converted_model
from dfm.data.mock import MockDataSettings, MockPackedLoader, MockPacking
from dfm.inference.checkpoint_loading import single_process_config

PATCH = 2  # FLUX packs 2x2 latent patches into a token


def reorder_patch_features(tensor: Tensor, dim: int, source: str, target: str, channels: int) -> Tensor:
    """Reorder the patch-feature axis ``dim`` from order ``source`` to ``target`` ('cpq' / 'pqc')."""
    sizes = {"c": channels, "p": PATCH, "q": PATCH}
    moved = tensor.movedim(dim, 0)
    grid = moved.reshape(*(sizes[a] for a in source), *moved.shape[1:])
    grid = grid.permute(*(source.index(a) for a in target), *range(3, grid.dim()))
    return grid.reshape(moved.shape).movedim(0, dim).contiguous()


def patch_features(dfm: str, diffusers: str, dim: int, channels: int) -> Rule:
    """A tensor whose axis ``dim`` runs over a token's patch features."""
    return Rule(
        dfm,
        (diffusers,),
        join=lambda t: reorder_patch_features(t[0], dim, "cpq", "pqc", channels),
        split=lambda t: [reorder_patch_features(t, dim, "pqc", "cpq", channels)],
    )


def swapped_halves(dfm: str, diffusers: str) -> Rule:
    """The two halves of dim 0 in the other order (an involution)."""

    def swap(tensor: Tensor) -> Tensor:
        first, second = tensor.chunk(2)
        return torch.cat([second, first])

    return Rule(dfm, (diffusers,), join=lambda t: swap(t[0]), split=lambda t: [swap(t)])


def _linear(dfm: str, diffusers: str) -> list[Rule]:
    return [rename(f"{dfm}.{p}", f"{diffusers}.{p}") for p in ("weight", "bias")]


class HeadNames(NamedTuple):
    """diffusers' names of one stream's q/k/v linears and per-head norms inside an attention module."""

    q: str
    k: str
    v: str
    norm_q: str
    norm_k: str


IMAGE_HEADS = HeadNames("to_q", "to_k", "to_v", "norm_q", "norm_k")
TEXT_HEADS = HeadNames("add_q_proj", "add_k_proj", "add_v_proj", "norm_added_q", "norm_added_k")


def _heads(dfm: str, attn: str, names: HeadNames, heads: int) -> list[Rule]:
    """A HeadProjection from diffusers' separate q/k/v linears and per-head norms."""
    q, k, v = (f"{attn}.{name}" for name in names[:3])
    fused = [fused_qkv(f"{dfm}.linear_qkv.{p}", f"{q}.{p}", f"{k}.{p}", f"{v}.{p}", heads) for p in ("weight", "bias")]
    norms = [rename(f"{dfm}.q_layernorm.weight", f"{attn}.{names.norm_q}.weight")]
    return fused + norms + [rename(f"{dfm}.k_layernorm.weight", f"{attn}.{names.norm_k}.weight")]


def _double_block(i: int, heads: int) -> list[Rule]:
    d, b = f"layers.{i}", f"transformer_blocks.{i}"
    return [
        *_linear(f"{d}.adaln.linear", f"{b}.norm1.linear"),
        *_linear(f"{d}.text_adaln.linear", f"{b}.norm1_context.linear"),
        *_heads(f"{d}.image_heads", f"{b}.attn", IMAGE_HEADS, heads),
        *_heads(f"{d}.text_heads", f"{b}.attn", TEXT_HEADS, heads),
        *_linear(f"{d}.linear_proj", f"{b}.attn.to_out.0"),
        *_linear(f"{d}.text_linear_proj", f"{b}.attn.to_add_out"),
        *_linear(f"{d}.mlp.linear_fc1", f"{b}.ff.net.0.proj"),
        *_linear(f"{d}.mlp.linear_fc2", f"{b}.ff.net.2"),
        *_linear(f"{d}.text_mlp.linear_fc1", f"{b}.ff_context.net.0.proj"),
        *_linear(f"{d}.text_mlp.linear_fc2", f"{b}.ff_context.net.2"),
    ]


def _single_block(i: int, j: int, heads: int) -> list[Rule]:
    d, b = f"layers.{i}", f"single_transformer_blocks.{j}"
    return [
        *_linear(f"{d}.adaln.linear", f"{b}.norm.linear"),
        *_heads(f"{d}.heads", f"{b}.attn", IMAGE_HEADS, heads),
        *_linear(f"{d}.proj_mlp", f"{b}.proj_mlp"),
        *_linear(f"{d}.proj_out", f"{b}.proj_out"),
    ]


def flux_rules(model: ModelConfig) -> list[Rule]:
    heads, channels = model.num_attention_heads, model.in_channels
    num_double = model.num_layers - model.num_single_layers
    embed = "time_text_embed"
    rules = [
        *_linear("t_embedder.mlp.0", f"{embed}.timestep_embedder.linear_1"),
        *_linear("t_embedder.mlp.2", f"{embed}.timestep_embedder.linear_2"),
        *_linear("pooled_embedder.0", f"{embed}.text_embedder.linear_1"),
        *_linear("pooled_embedder.2", f"{embed}.text_embedder.linear_2"),
        *_linear("context_embedder", "context_embedder"),
        patch_features("x_embedder.weight", "x_embedder.weight", 1, channels),
        rename("x_embedder.bias", "x_embedder.bias"),
        swapped_halves("final_layer.adaln.weight", "norm_out.linear.weight"),
        swapped_halves("final_layer.adaln.bias", "norm_out.linear.bias"),
        patch_features("final_layer.linear.weight", "proj_out.weight", 0, channels),
        patch_features("final_layer.linear.bias", "proj_out.bias", 0, channels),
    ]
    if model.guidance_embeds:
        rules += _linear("guidance_embedder.mlp.0", f"{embed}.guidance_embedder.linear_1")
        rules += _linear("guidance_embedder.mlp.2", f"{embed}.guidance_embedder.linear_2")
    for i in range(num_double):
        rules += _double_block(i, heads)
    for j in range(model.num_single_layers):
        rules += _single_block(num_double + j, j, heads)
    return rules


def model_overrides(config: dict) -> dict:
    """diffusers config.json -> dfm model keys."""
    if config.get("patch_size", 1) != 1:
        raise ConversionError(
            f"FLUX patch_size={config['patch_size']}: only 1 (2x2 latent patches packed) is supported"
        )
    in_channels = config.get("in_channels", 64)
    if in_channels % PATCH**2 or config.get("out_channels") not in (None, in_channels):
        raise ConversionError(f"FLUX in_channels={in_channels}, out_channels={config.get('out_channels')}: unsupported")
    heads, head_dim = config.get("num_attention_heads", 24), config.get("attention_head_dim", 128)
    double, single = config.get("num_layers", 19), config.get("num_single_layers", 38)
    return {
        "model.num_layers": double + single,
        "model.num_single_layers": single,
        "model.hidden_size": heads * head_dim,
        "model.num_attention_heads": heads,
        "model.ffn_hidden_size": 4 * heads * head_dim,
        "model.in_channels": in_channels // PATCH**2,
        "model.out_channels": None,
        "model.patch_spatial": PATCH,
        "model.patch_temporal": 1,
        "model.text_embed_dim": config.get("joint_attention_dim", 4096),
        "model.pooled_text_dim": config.get("pooled_projection_dim", 768),
        "model.guidance_embeds": bool(config.get("guidance_embeds", False)),
        "model.rope_axes_dim": list(config.get("axes_dims_rope", (16, 56, 56))),
        "model.qk_layernorm": True,
        "model.layernorm_epsilon": 1e-6,
        "model.pipeline": "flow",
    }


def diffusers_config(model: ModelConfig) -> dict:
    return {
        "patch_size": 1,
        "in_channels": model.in_channels * PATCH**2,
        "out_channels": None,
        "num_layers": model.num_layers - model.num_single_layers,
        "num_single_layers": model.num_single_layers,
        "attention_head_dim": model.hidden_size // model.num_attention_heads,
        "num_attention_heads": model.num_attention_heads,
        "joint_attention_dim": model.text_embed_dim,
        "pooled_projection_dim": model.pooled_text_dim,
        "guidance_embeds": model.guidance_embeds,
        "axes_dims_rope": list(model.rope_axes_dim),
    }


def diffusers_inputs(batch, x_in: Tensor, t: Tensor, guidance: Tensor | None, sample: int, channels: int) -> dict:
    """Sample ``sample`` of a pack as FluxTransformer2DModel's keyword arguments (batch of one)."""
    host = batch.host_view()
    q0, k0 = int(host.cu_seqlens_q_padded[sample]), int(host.cu_seqlens_kv_padded[sample])
    q1, k1 = q0 + int(host.sample_lengths[sample]), k0 + int(host.text_lengths[sample])
    tokens = reorder_patch_features(x_in[q0:q1], 1, "pqc", "cpq", channels)
    text = batch.context[k0:k1]
    return dict(
        hidden_states=tokens[None],
        encoder_hidden_states=text[None],
        pooled_projections=batch.pooled_text[sample : sample + 1],
        timestep=t[sample : sample + 1],
        img_ids=batch.pos_ids[q0:q1].float(),
        txt_ids=torch.zeros(k1 - k0, 3, device=text.device),
        guidance=None if guidance is None else guidance[sample : sample + 1],
    )


def diffusers_outputs(diffusers_model, batch, t: Tensor, guidance: Tensor | None, channels: int) -> list[Tensor]:
    """Each sample of ``batch`` run alone through diffusers -> its output [L_i, D] in dfm's feature order."""
    with torch.no_grad():
        return [
            reorder_patch_features(
                diffusers_model(**diffusers_inputs(batch, batch.latents, t, guidance, i, channels)).sample[0],
                1,
                "cpq",
                "pqc",
                channels,
            )
            for i in range(batch.num_samples)
        ]


def per_sample_max_abs_diff(packed: Tensor, references: list[Tensor], batch) -> list[float]:
    """max |packed rows of sample i - references[i]| for every sample of ``batch``."""
    starts = batch.host_view().cu_seqlens_q_padded.tolist()
    return [float((packed[start : start + ref.shape[0]] - ref).abs().max()) for start, ref in zip(starts, references)]


def verification_pack(model_cfg: ModelConfig, seed: int = 0, padding: tuple[int, int] = (1, 1)):
    """(pack, t [N], guidance [N] or None): three images of different sizes (16, 15, 15 tokens) and
    text lengths; ``padding``: the layout's (segment, total) multiples."""
    settings = MockDataSettings(
        seed=seed,
        image_sizes=[(8, 8), (6, 10), (10, 6)],
        image_fraction=1.0,
        text_len_range=(3, 12),
        in_channels=model_cfg.in_channels,
        text_embed_dim=model_cfg.text_embed_dim,
        pooled_text_dim=model_cfg.pooled_text_dim,
    )
    batch = next(MockPackedLoader(settings, 0, 1, MockPacking(10**6, *padding, samples_per_pack=3)))
    t = torch.rand(3, generator=torch.Generator().manual_seed(seed))
    return batch, t, torch.full((3,), 3.5) if model_cfg.guidance_embeds else None


def verify(folder: str, cfg: ConfigContainer, weights: Callable[[], Iterable[tuple[str, Tensor]]]) -> float:
    """Max abs diff of dfm (``weights()``: its (name, tensor) pairs) vs diffusers (the model or pipeline
    folder ``folder``) on ``verification_pack`` (fp32, one process); the two models run one after the other."""
    model_cfg = single_process_config(cfg).model
    batch, t, guidance = verification_pack(model_cfg)

    def run(reference) -> list[Tensor]:
        return diffusers_outputs(reference, batch, t, guidance, model_cfg.in_channels)

    references = diffusers_outputs_alone(folder, "FluxTransformer2DModel", run)
    with converted_model(model_cfg, weights(), cfg.rng.seed) as model:
        packed = model(batch.latents, t, batch, guidance)
    return max(per_sample_max_abs_diff(packed, references, batch))


FLUX = Family(
    architecture="flux",
    diffusers_class="FluxTransformer2DModel",
    model_overrides=model_overrides,
    diffusers_config=diffusers_config,
    rules=flux_rules,
    verify=verify,
)
