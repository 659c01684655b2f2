"""The benchmark ladders: named lists of configurations, each a recipe plus config overrides.

Token counts below are video tokens per sample after 2x2 spatial patching of the latent:
an image latent [H, W] gives H*W/4 tokens, a video latent [T, H, W] gives T*H*W/4.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

TINY_YAML = "examples/megatron/recipes/dit/conf/dit_tiny.yaml"
DIGITS_VIDEO_YAML = "examples/megatron/recipes/dit/conf/digits_video_tiny.yaml"
# The CI video config on mock clips of its shape: 1-channel [4, 16, 16] latents (32 tokens a clip after
# 2x4x4 patches), 64 clips per 2048-token pack, captions of 8-16 tokens, one pack a step.
DIGITS_VIDEO = [
    "dataset.mock_video_sizes=[[4,16,16]]",
    "dataset.mock_image_fraction=0.0",
    "dataset.mock_text_len_range=[8,16]",
    "dataset.num_workers=0",
]

# The config's pack length restated, so the GPU ladder's CPU-size rehearsal shrinks it with the clips.
X16 = ["train.global_batch_size=16", "dataset.seq_length=2048"]
DIGITS_RUNGS = {"digits-video": [*DIGITS_VIDEO, "model.architecture=dit_cross"], "digits-video-moviegen": DIGITS_VIDEO}


@dataclass
class Rung:
    name: str
    overrides: list[str] = field(default_factory=list)
    config_file: str | None = None
    recipe: str | None = None
    variant: str = "default"  # a named speed experiment applied to dfm only (benchmarks/variants.py)
    reference: bool = True  # also time the plain-PyTorch reference on the same packs
    # A mixed rung: the fixed-size rungs (one sample shape each, same packed token count) whose
    # speeds its samples are compared with (report.mixed_vs_fixed).
    mix_of: list[str] = field(default_factory=list)
    # Timed steps at least this many whatever --steps says: a rung of ~0.1 s steps timed over 10 moved
    # its ratio by 3-8 % between passes of one call; over 40, by 0-2 % (CPU, 2026-11-30).
    min_steps: int = 0

    def timed_steps(self, steps: int) -> int:
        return max(steps, self.min_steps)


SHORT_STEPS = 40  # the min_steps of the CPU rungs whose steps take ~0.1 s


def model(hidden: int, heads: int, layers: int, architecture: str = "dit_cross") -> list[str]:
    return [
        f"model.hidden_size={hidden}",
        f"model.num_attention_heads={heads}",
        f"model.num_layers={layers}",
        f"model.architecture={architecture}",
    ]


def data(seq_length: int, images: list, videos: list, image_fraction: float, packs_per_step: int = 1) -> list[str]:
    """Mock data: each step is ``packs_per_step`` micro-batches, each a pack of <= seq_length tokens."""
    return [
        f"dataset.seq_length={seq_length}",
        f"dataset.mock_image_sizes={images or [[8, 8]]}".replace(" ", ""),
        f"dataset.mock_video_sizes={videos or [[1, 8, 8]]}".replace(" ", ""),
        f"dataset.mock_image_fraction={image_fraction}",
        f"train.global_batch_size={packs_per_step}",
    ]


BF16 = ["mixed_precision.precision=bf16"]
FP8 = ["mixed_precision.fp8=hybrid"]  # the block linears' products in FP8 (dfm/models/common/fp8_linear.py)
LATENT = ["model.in_channels=4", "model.text_embed_dim=4096", "dataset.mock_text_len_range=[64,128]"]
# The DiT-7B preset's block (NeMo's DiT7BConfig): low-rank adaLN, 1024-wide text context, RMSNorm, no
# linear biases, q/k norm. The plain-PyTorch reference has none of these, so its rungs time dfm alone.
DIT_7B_BLOCK = [
    "model.adaln_lora_dim=256",
    "model.cross_attention_dim=1024",
    "model.normalization=rmsnorm",
    "model.add_bias_linear=false",
    "model.qk_layernorm=true",
]
# DiT-XL/2 as in the paper: 28 layers, hidden 1152, 16 heads, 32x32x4 latents (256 tokens).
XL2 = model(1152, 16, 28, "dit_adaln") + ["model.in_channels=4"]


def cpu_ladder() -> list[Rung]:
    tiny = [
        Rung("tiny-256-mix", config_file=TINY_YAML, min_steps=SHORT_STEPS),
        Rung("tiny-256-image", ["dataset.mock_image_fraction=1.0"], config_file=TINY_YAML, min_steps=SHORT_STEPS),
        Rung("tiny-1k-mix", ["dataset.seq_length=1024"], config_file=TINY_YAML, min_steps=SHORT_STEPS),
    ]
    digits = [
        Rung(name, overrides, config_file=DIGITS_VIDEO_YAML, min_steps=SHORT_STEPS)
        for name, overrides in DIGITS_RUNGS.items()
    ]
    small = model(256, 4, 4) + ["model.in_channels=4", "model.text_embed_dim=64"]
    # The mixed rung's samples come in four shapes; each also runs alone in 4k-token packs.
    fixed = [
        Rung("small-4k-fixed-256", small + data(4096, [[32, 32]], [], 1.0), reference=False),
        Rung("small-4k-fixed-128", small + data(4096, [[16, 32]], [], 1.0), reference=False),
        Rung("small-4k-fixed-512", small + data(4096, [], [[2, 32, 32]], 0.0), reference=False),
    ]
    mixed = data(4096, [[32, 32], [16, 32]], [[4, 32, 32], [2, 32, 32]], 0.5)
    return (
        tiny
        + digits
        + [
            Rung("small-4k-video", small + data(4096, [], [[4, 32, 32]], 0.0)),  # fixed, 1024 tokens
            Rung("small-4k-mix", small + mixed, mix_of=["small-4k-video", *(r.name for r in fixed)]),
            *fixed,
        ]
    )


def gpu_smoke_ladder() -> list[Rung]:
    """A cheap first GPU call: imports, one small model through every backend."""
    small = model(512, 8, 4) + LATENT + BF16
    mix = data(8192, [[32, 32], [64, 64]], [[4, 32, 32]], 0.5)
    return [
        Rung("smoke-8k-mix-flex", small + mix + ["model.attention_backend=flex"]),
        Rung("smoke-8k-mix-sdpa", small + mix + ["model.attention_backend=sdpa"], reference=False),
        Rung(
            "smoke-8k-mix-nomaskcache",
            small + mix + ["model.attention_backend=flex"],
            variant="flex_mask_per_call",
            reference=False,
        ),
        Rung("smoke-8k-mix-compiled", small + mix + ["model.compile=true"], reference=False),
    ]


def gpu_ladder() -> list[Rung]:
    # 'auto' attention: torch's varlen flash kernel on CUDA (TE when installed); the -flex rungs keep
    # FlexAttention for the before/after, and variants that patch FlexAttention's path run on it.
    flex = ["model.attention_backend=flex"]
    h4096 = LATENT + BF16
    # 8k tokens per sample: a 2x128x128 latent video (2 * 64 * 64 tokens).
    one_8k_video = data(8192, [], [[2, 128, 128]], 0.0, packs_per_step=2)
    xl2 = XL2 + BF16 + data(16384, [[32, 32]], [], 1.0, packs_per_step=4)
    cross = model(1152, 16, 28) + LATENT + BF16
    fixed_1k = data(16384, [[64, 64]], [], 1.0, packs_per_step=2)  # 16 images of 1k tokens per pack
    mixed = data(16384, [[32, 32], [64, 64]], [[4, 64, 64], [2, 64, 64]], 0.5, packs_per_step=2)

    def variant_pair(suffix: str, variant: str, extra: Sequence[str] = ()) -> list[Rung]:
        """A code variant on the h4096 8k-video rung and on the XL/2 image rung (``extra`` overrides on both)."""
        video = model(4096, 32, 6) + h4096 + [*extra] + one_8k_video
        return [
            Rung(f"h4096-8k-L6-{suffix}", video, variant=variant, reference=False),
            Rung(f"xl2-256-img-{suffix}", xl2 + [*extra], variant=variant, reference=False),
        ]

    # The mixed rung's other sample shapes, each alone in 16k-token packs.
    other_fixed = [
        Rung("cross-256-img-fixed", cross + data(16384, [[32, 32]], [], 1.0, packs_per_step=2), reference=False),
        Rung("cross-2k-video-fixed", cross + data(16384, [], [[2, 64, 64]], 0.0, packs_per_step=2), reference=False),
        Rung("cross-4k-video-fixed", cross + data(16384, [], [[4, 64, 64]], 0.0, packs_per_step=2), reference=False),
    ]
    return [
        # h4096 rungs: the DiT-12B block (full adaLN, hidden-wide context); dit7b: DiT-7B's, 6 of its 28 layers.
        Rung("h4096-8k-L8", model(4096, 32, 8) + h4096 + one_8k_video),
        Rung("dit7b-8k-L6", model(4096, 32, 6) + DIT_7B_BLOCK + h4096 + one_8k_video, reference=False),
        Rung("h4096-8k-L6", model(4096, 32, 6) + h4096 + one_8k_video),
        Rung("xl2-256-img", xl2),
        Rung("cross-1k-img-fixed", cross + fixed_1k),
        *other_fixed,
        Rung("cross-16k-mix-packed", cross + mixed, mix_of=["cross-1k-img-fixed", *(r.name for r in other_fixed)]),
        Rung("h4096-8k-L6-flex", model(4096, 32, 6) + h4096 + flex + one_8k_video, reference=False),
        Rung("xl2-256-img-flex", xl2 + flex, reference=False),
        Rung("cross-16k-mix-flex", cross + flex + mixed, reference=False),
        Rung("xl2-256-img-nomaskcache", xl2 + flex, variant="flex_mask_per_call", reference=False),
        Rung("xl2-256-img-compiled", xl2 + ["model.compile=true"], reference=False),
        Rung(
            "h4096-8k-L6-compiled", model(4096, 32, 6) + h4096 + ["model.compile=true"] + one_8k_video, reference=False
        ),
        *variant_pair("rows-index-add", "rows_index_add"),
        *variant_pair("uniform-varlen", "uniform_packs_varlen"),
        # FP8 products on the acceptance rungs (bf16 parameters and attention), against their bf16 runs.
        Rung("h4096-8k-L6-fp8", model(4096, 32, 6) + h4096 + FP8 + one_8k_video, reference=False),
        Rung("xl2-256-img-fp8", xl2 + FP8, reference=False),
        Rung("cross-64k-video", cross + data(65536, [], [[16, 128, 128]], 0.0, packs_per_step=1)),
        Rung(
            "cross-64k-video-L12",
            cross + ["model.num_layers=12"] + data(65536, [], [[16, 128, 128]], 0.0, packs_per_step=1),
        ),
        Rung(
            "xl2-256-img-sdpa",
            XL2 + BF16 + ["model.attention_backend=sdpa"] + data(16384, [[32, 32]], [], 1.0, 4),
            reference=False,
        ),
        Rung(
            "cross-16k-mix-sdpa",
            model(1152, 16, 28) + LATENT + BF16 + ["model.attention_backend=sdpa"] + mixed,
            reference=False,
        ),
        # The CI video config (the CPU ladder's digits rungs) with 16 packs a step: 1024 clips, a GPU's load.
        *(
            Rung(f"{name}-x16", [*overrides, *X16], config_file=DIGITS_VIDEO_YAML)
            for name, overrides in DIGITS_RUNGS.items()
        ),
    ]


# The gpu ladder's rungs at CPU size (same names, backends, variants, reference and mix_of), for
# rehearsing a device run here (scripts/gpu/lease.sh with DFM_GPU_DRYRUN=1): model width 64, 4 heads,
# 2 layers; packs 16x shorter, latents 4x smaller in height and width (16x fewer tokens per sample).
SHRINK = {
    "model.hidden_size": lambda _: "64",
    "model.num_attention_heads": lambda _: "4",
    "model.num_layers": lambda _: "2",
    "model.text_embed_dim": lambda _: "32",
    "model.cross_attention_dim": lambda _: "32",
    "model.adaln_lora_dim": lambda _: "16",
    "dataset.mock_text_len_range": lambda _: "[4,8]",
    "dataset.seq_length": lambda value: str(int(value) // 16),
    "dataset.mock_image_sizes": lambda value: _quarter_sides(value),
    "dataset.mock_video_sizes": lambda value: _quarter_sides(value),
}


def _quarter_sides(sizes: str) -> str:
    """'[[t,]h,w],...' -> the same list with h and w divided by 4."""
    shapes = json.loads(sizes)
    return json.dumps([[*shape[:-2], shape[-2] // 4, shape[-1] // 4] for shape in shapes]).replace(" ", "")


def shrunk(rung: Rung) -> Rung:
    overrides = []
    for override in rung.overrides:
        key, value = override.split("=", 1)
        overrides.append(f"{key}={SHRINK[key](value)}" if key in SHRINK else override)
    return dataclasses.replace(rung, overrides=overrides)


def gpu_rehearsal_ladder() -> list[Rung]:
    return [shrunk(rung) for rung in gpu_ladder()]


LADDERS = {"cpu": cpu_ladder, "gpu-smoke": gpu_smoke_ladder, "gpu": gpu_ladder, "gpu-rehearsal": gpu_rehearsal_ladder}


def get_ladder(name: str) -> list[Rung]:
    if name not in LADDERS:
        raise SystemExit(f"unknown ladder {name!r}; valid: {sorted(LADDERS)}")
    return LADDERS[name]()
