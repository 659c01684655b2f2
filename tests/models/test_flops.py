"""The model FLOPs function agrees with torch's FlopCounterMode (forward + backward) within 5%."""

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dfm.models.flops import training_flops
from tests.models._helpers import (
    ARCHITECTURES,
    build_random_model,
    conditioning,
    make_samples,
    pack_samples,
    tiny_config,
)


def counted_training_flops(model, pack, c_noise, labels) -> int:
    # The math SDPA kernel is made of matmuls the counter sees (CPU flash attention is not registered).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(pack.latents, c_noise, pack, labels).square().mean().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_flops_function_matches_flop_counter(dist, name):
    cfg = tiny_config(name, hidden_size=64, num_attention_heads=4, attention_backend="sdpa")
    model = build_random_model(cfg)
    pack = pack_samples(make_samples(cfg))
    c_noise, labels = conditioning(pack.num_samples)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    counted = counted_training_flops(model, pack, c_noise, labels)
    video_lens = torch.diff(pack.cu_seqlens_q).tolist()
    text_lens = torch.diff(pack.cu_seqlens_kv).tolist()
    frames = (pack.latent_shape[:, 1] // cfg.patch_temporal).tolist()
    predicted = training_flops(cfg, video_lens, text_lens, frames)
    assert abs(predicted / counted - 1) < 0.05, f"{name}: predicted {predicted:.4g}, counted {counted:.4g}"
