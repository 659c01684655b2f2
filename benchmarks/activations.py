"""Bytes a block saves for backward, per token per hidden unit per layer: dfm, the plain-PyTorch
reference DiT (``benchmarks/reference_dit.py``) and the analytic minimum, per family and dtype.

    python -m benchmarks.activations [--hidden 512 --samples 4 --video 4 32 32 --text 64 --json OUT]

Counted as ``dfm.training.memory_plan`` describes: ``torch.autograd.graph.saved_tensors_hooks`` over
one training forward, unique storages (by ``untyped_storage().data_ptr()``), parameters excluded. Per
layer = (a model one block deeper) - (the model): embedders and the final layer drop out. Per token:
per video token (a text token's cross-attention keys / values are charged to the video tokens); FLUX
per token of the joint text + video sequence (its blocks carry both): ``flux`` counts one
double-stream block, ``flux_single`` one single-stream block. bf16 runs the model in bf16
(dfm: ``Float16Module``; reference: ``.bfloat16()``) so it is half of fp32 where every saved tensor
has the run's dtype. ``analytic``: the tensors a minimal block keeps (``ANALYTIC``, in h-vectors per
token, docs/performance.md "Activations per token").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dfm.config.container import ModelConfig

TEXT_DIM = 24
FLUX = dict(architecture="flux", pooled_text_dim=12, guidance_embeds=True, pipeline="flow", qk_layernorm=True)
FAMILIES = {  # each family at its defaults (3D RoPE, no q / k norm where optional)
    "dit_adaln": dict(architecture="dit_adaln", num_classes=10),
    "dit_cross": dict(architecture="dit_cross"),
    "stdit": dict(architecture="stdit"),
    "moviegen": dict(architecture="moviegen"),
    "wan": dict(architecture="wan", pipeline="flow"),
    "flux": FLUX,  # one double-stream block
    "flux_single": FLUX,  # one single-stream block
}
REFERENCE = ("dit_adaln", "dit_cross")  # the families benchmarks/reference_dit.py writes
DTYPES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class Block:
    """A minimal block's saved tensors, in h-vectors (h elements) per video token unless named:
    Korthikanti et al. 2022 (Table 2) without dropout and with flash attention (no s^2 term; its
    logsumexp, heads / h per token, is left out), plus what adaLN modulation, cross-attention, q / k
    norms and a gated MLP add. Defaults: the DiT block with adaLN-Zero and no text (dit_adaln)."""

    attention: float = 6.0  # per self-attention: norm input, qkv-linear input, Q, K, V, output (proj input)
    mlp: float = 2.0  # norm input, fc1 input
    ffn: float = 2.0  # per FFN unit: fc1 output (activation input), activation output (fc2 input)
    modulated: float = 2.0  # per modulated branch: normed x (for d scale), branch output (for d gate)
    cross_attention: float = 0.0  # norm input, q-linear input, Q, output
    text: float = 0.0  # per text token: cross-attention K, V
    qk_norm: float = 0.0  # the normalised q / k's inputs
    self_attentions: int = 1
    norms: int = 2  # token norms, each keeping statistics per token: LayerNorm mean + rstd, RMSNorm rstd
    norm_stats: int = 2
    per_sample: float = 8.0  # the modulation's input c, SiLU(c), its output (shift / scale / gate x 2)
    mlp_branch: bool = True  # the MLP a branch of its own (not beside the attention, on its normed input)

    def vectors(self, h: int, ffn: int, text_per_token: float, tokens_per_sample: float) -> float:
        """h-vectors per (video) token."""
        return (
            self.self_attentions * self.attention
            + self.mlp
            + self.ffn * ffn / h
            + (self.self_attentions + self.mlp_branch) * self.modulated
            + self.cross_attention
            + self.text * text_per_token
            + self.qk_norm
            + self.norms * self.norm_stats / h
            + self.per_sample / tokens_per_sample
        )


CROSS = dict(cross_attention=4.0, text=2.0, norms=3)
ANALYTIC = {
    "dit_adaln": Block(),
    "dit_cross": Block(**CROSS),
    # Spatial and temporal self-attention, each modulated (9 modulation vectors).
    "stdit": Block(**{**CROSS, "norms": 4}, self_attentions=2, per_sample=11.0),
    # SwiGLU: fc1 output is 2 f wide (gate and up), the product f wide: 3 per FFN unit, not 2. RMSNorm.
    "moviegen": Block(**CROSS, ffn=3.0, norm_stats=1),
    # q / k RMS-normalised in self- (q, k) and cross-attention (q; k per text token).
    "wan": Block(cross_attention=5.0, text=3.0, norms=3, qk_norm=2.0),
    # Double-stream, per joint token (text tokens run the block on their own weights, own modulation);
    # q / k RMSNorm.
    "flux": Block(qk_norm=2.0, per_sample=14.0),
    # Single-stream, per joint token: attention and MLP side by side on one normed, modulated input (no
    # MLP norm or fc1 input of its own), one gate; proj_out's input is the attention output and the
    # activation output, both counted already. One modulation (shift / scale / gate) for both streams.
    "flux_single": Block(mlp=0.0, qk_norm=2.0, norms=1, per_sample=5.0, mlp_branch=False),
}
HEADS = 8  # head dim 64 at the default hidden 512


def model_config(
    family: str, hidden: int, layers: int, text_len: int, ffn: int, heads: int = HEADS, **extra
) -> ModelConfig:
    """A small ``family`` model: ``heads`` heads, ``ffn`` x hidden FFN, SDPA attention."""
    fields = dict(FAMILIES[family], **extra)
    if fields["architecture"] == "flux":
        head = hidden // heads
        axis = (3 * head // 8) // 2 * 2
        fields.setdefault("num_single_layers", 1)
        fields.update(rope_axes_dim=[head - 2 * axis, axis, axis])
    return ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=ffn * hidden,
        in_channels=4,
        text_embed_dim=TEXT_DIM,
        max_text_len=text_len,
        max_latent_thw=[8, 32, 32],
        attention_backend="sdpa",
        **fields,
    )


def saved_bytes(model: torch.nn.Module, forward) -> int:
    """Unique storage bytes autograd saves during ``forward()`` (parameters are not activations)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes():
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(seen.values())


def mock_pack(cfg: ModelConfig, video: tuple[int, int, int], samples: int):
    """One pack of ``samples`` videos of latent ``video`` [T, H, W], ``max_text_len`` text tokens each."""
    from dfm.data.mock import MockDataSettings, MockPackedLoader, MockPacking

    settings = MockDataSettings(
        seed=0,
        video_sizes=[video],
        image_fraction=0.0,
        text_len_range=(cfg.max_text_len, cfg.max_text_len),
        in_channels=cfg.in_channels,
        text_embed_dim=TEXT_DIM,
        pooled_text_dim=cfg.pooled_text_dim,
    )
    return next(MockPackedLoader(settings, 0, 1, MockPacking(10**6, samples_per_pack=samples)))


def measure(
    cfg: ModelConfig, video: tuple[int, int, int], samples: int = 2, precision: str = "bf16"
) -> tuple[int, int, int]:
    """(saved bytes, video tokens, text tokens) of one training forward of dfm's model on one pack."""
    from megatron.core.transformer.module import Float16Module

    from dfm.convert.weights import single_process_world
    from dfm.models.build import build_model_chunk

    batch = mock_pack(cfg, video, samples)
    t = torch.rand(samples, generator=torch.Generator().manual_seed(0))
    extra = {"flux": torch.full((samples,), 3.5), "dit_adaln": torch.zeros(samples, dtype=torch.long)}
    with single_process_world(0):
        model, tconfig = build_model_chunk(cfg, precision, 0)
        if precision == "bf16":
            model = Float16Module(tconfig, model)  # casts inputs to bf16 as training does
        model.train()
        measured = saved_bytes(model, lambda: model(batch.latents, t, batch, extra.get(cfg.architecture)))
    return measured, batch.latents.shape[0], samples * cfg.max_text_len


def measure_reference(cfg: ModelConfig, video: tuple[int, int, int], samples: int, precision: str) -> int:
    """Saved bytes of the reference DiT's forward on the same pack (one batch per latent shape)."""
    from benchmarks.reference_dit import ReferenceDiT, batches_from_pack

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = ReferenceDiT(cfg).to(dtype).train()
    t = torch.rand(samples, generator=torch.Generator().manual_seed(0))

    def forward():
        for b in batches_from_pack(mock_pack(cfg, video, samples)):
            model(b.latents.to(dtype), t[: b.latents.shape[0]], b.pos_ids, b.text.to(dtype), b.text_mask)

    return saved_bytes(model, forward)


@dataclass(frozen=True)
class Workload:
    hidden: int = 512
    samples: int = 4
    video: tuple[int, int, int] = (4, 32, 32)  # latent [T, H, W]: 1024 tokens at patch 1 x 2 x 2
    text: int = 64
    ffn: int = 4
    recompute_activation: bool = False  # model.recompute_activation


def depths(family: str) -> tuple[dict, dict]:
    """Two model depths one block apart (FLUX: one double-stream block more, one single-stream block in
    both; or one single-stream block more, one double-stream block in both)."""
    if family == "flux":
        return dict(layers=3, num_single_layers=1), dict(layers=2, num_single_layers=1)
    if family == "flux_single":
        return dict(layers=3, num_single_layers=2), dict(layers=2, num_single_layers=1)
    return dict(layers=2), dict(layers=1)


def joint(family: str) -> bool:
    """Whether the family's blocks carry the text tokens too (counted per joint token)."""
    return FAMILIES[family]["architecture"] == "flux"


def measure_dfm(cfg: ModelConfig, video: tuple[int, int, int], samples: int, precision: str) -> int:
    return measure(cfg, video, samples, precision)[0]


def per_layer(family: str, work: Workload, precision: str, counter=measure_dfm) -> float:
    """Saved bytes of one block per token per hidden unit: (deeper model - shallower model) / (tokens h)."""
    counts = []
    for depth in depths(family):
        layers = depth.pop("layers")
        depth.update(recompute_activation=work.recompute_activation)
        cfg = model_config(family, work.hidden, layers, work.text, work.ffn, **depth)
        counts.append(counter(cfg, work.video, work.samples, precision))
    tokens = work.samples * tokens_per_video(work)
    if joint(family):
        tokens += work.samples * work.text
    return (counts[0] - counts[1]) / (tokens * work.hidden)


def tokens_per_video(work: Workload) -> int:
    t, h, w = work.video
    return t * (h // 2) * (w // 2)  # the default patch: 1 x 2 x 2


def analytic(family: str, work: Workload, precision: str) -> float:
    """The minimal block's bytes per token per hidden unit (``ANALYTIC``)."""
    per_video = tokens_per_video(work)
    tokens = per_video + work.text if joint(family) else per_video
    block = ANALYTIC[family]
    vectors = block.vectors(work.hidden, work.ffn * work.hidden, work.text / per_video, tokens)
    return vectors * DTYPES[precision]


def results(work: Workload, families, dtypes) -> Iterator[dict]:
    """One row per family and dtype, as each is counted."""
    for family in families:
        for precision in dtypes:
            ref = per_layer(family, work, precision, measure_reference) if family in REFERENCE else None
            dfm = per_layer(family, work, precision)
            yield dict(arch=family, dtype=precision, dfm=dfm, reference=ref, analytic=analytic(family, work, precision))


def format_row(row: dict) -> str:
    ref = "—" if row["reference"] is None else f"{row['reference']:.1f}"
    return f"{row['arch']} {row['dtype']}: dfm {row['dfm']:.1f}, reference {ref}, analytic {row['analytic']:.1f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=Workload.hidden)
    parser.add_argument("--samples", type=int, default=Workload.samples, help="videos in the pack")
    parser.add_argument("--video", type=int, nargs=3, default=Workload.video, metavar=("T", "H", "W"))
    parser.add_argument("--text", type=int, default=Workload.text, help="text tokens per video")
    parser.add_argument("--family", action="append", choices=list(FAMILIES), help="repeatable; default all")
    parser.add_argument("--dtype", action="append", choices=list(DTYPES), help="repeatable; default both")
    parser.add_argument("--recompute-activation", action="store_true", help="dfm: model.recompute_activation=true")
    parser.add_argument("--json", help="write the rows (and the workload) here")
    args = parser.parse_args(argv)
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    work = Workload(args.hidden, args.samples, tuple(args.video), args.text, Workload.ffn, args.recompute_activation)
    rows = []
    for row in results(work, args.family or list(FAMILIES), args.dtype or list(DTYPES)):
        print(format_row(row), flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(workload=dataclasses.asdict(work), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
