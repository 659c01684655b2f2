"""The Wan presets have exactly the parameters of diffusers' models with the published configs
(Wan-AI/Wan2.1-T2V-1.3B-Diffusers, -14B-Diffusers, Wan2.2-TI2V-5B-Diffusers), and their recipes train as Wan does."""

from dfm.config.recipes import get_recipe
from dfm.models.presets_cli import preset_parameter_counts

PUBLISHED = {
    "Wan2.1-T2V-1.3B": 1_418_996_800,
    "Wan2.1-T2V-14B": 14_288_491_584,
    "Wan2.2-TI2V-5B": 4_999_787_712,  # Wan-AI/Wan2.2-TI2V-5B-Diffusers
    "Wan2.2-T2V-A14B": 14_288_491_584,  # per expert (transformer/, transformer_2/)
    # per expert; 36 input channels (latent, mask, image latent) add 20 x 4 x 5120 patch-embedding weights
    "Wan2.2-I2V-A14B": 14_288_491_584 + 20 * 4 * 5120,
}


def test_wan_presets_have_the_published_parameter_counts():
    assert preset_parameter_counts(list(PUBLISHED)) == PUBLISHED


def test_wan_recipes_use_wans_timestep_and_shift():
    for name in PUBLISHED:
        cfg = get_recipe(name)
        assert (cfg.model.architecture, cfg.model.pipeline, cfg.model.max_text_len) == ("wan", "flow", 512)
        shift = 12.0 if name == "Wan2.2-T2V-A14B" else 5.0  # Wan 2.2's sample_shift
        assert (cfg.flow.c_noise_scale, cfg.flow.shift) == (1000.0, shift)
