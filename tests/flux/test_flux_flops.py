"""FLUX's FLOPs function agrees with torch's FlopCounterMode (forward + backward) within 5%."""

from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dfm.convert.flux import verification_pack
from dfm.convert.weights import single_process_world
from dfm.models.flops import training_flops
from tests._parity import converted_model
from tests.flux._tiny import dfm_config_and_weights, tiny_diffusers_flux


def test_flux_flops_match_flop_counter():
    cfg, weights = dfm_config_and_weights(tiny_diffusers_flux(num_attention_heads=4, attention_head_dim=16))
    batch, t, guidance = verification_pack(cfg.model)
    with single_process_world(cfg.rng.seed):
        model = converted_model(cfg, weights)
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(batch.latents, t, batch, guidance).square().mean().backward()
    predicted = training_flops(cfg.model, batch.host_sample_lengths(), batch.host_text_lengths())
    assert abs(predicted / counter.get_total_flops() - 1) < 0.05, (predicted, counter.get_total_flops())
