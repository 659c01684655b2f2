"""LoRA on dfm's Wan and FLUX equals diffusers with the exported LoRA file loaded.

Per family, one process, fp32, tiny random models: adapters with B = 0 leave the output bit for bit
unchanged; after two optimizer steps on the adapters alone (base frozen), dfm's output equals
diffusers' base transformer with the exported file loaded through ``pipeline.load_lora_weights``
(a pipeline holding only the transformer) within 1e-5, and the merged export loaded as a plain
diffusers model equals that too. Targets cover fused (q/k/v, k/v: some parts only), row-parallel,
MLP, FLUX's adaLN (gathered column-parallel) and final projection (a plain Linear, rows reordered).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from dfm.config.peft import PeftConfig
from dfm.convert.rules import to_diffusers
from dfm.convert.weights import fill_weights
from dfm.inference.empty_model import empty_model
from dfm.peft.export import lora_metadata, lora_state_dict, merged_weights
from dfm.peft.inject import add_lora
from tests.flux._tiny import dfm_config_and_weights, tiny_diffusers_flux
from tests.models.conftest import dist  # noqa: F401  (one-process megatron state)
from tests.wan._tiny import TEXT_LEN, tiny_diffusers_wan, tiny_model_config

TOLERANCE = 1e-5
WAN_TARGETS = ["to_q", "to_v", "attn1.to_out.0", "attn2.to_k", "ffn.net.0.proj", "ffn.net.2"]
FLUX_TARGETS = ["to_q", "to_k", "add_v_proj", "to_out.0", "to_add_out", "ff.net.0.proj", "proj_mlp", "proj_out"]
FLUX_TARGETS += ["norm1.linear"]


class Wan:
    """The Wan family's model, inputs and diffusers run."""

    targets = WAN_TARGETS

    def __init__(self):
        from dfm.convert.rules import to_dfm
        from dfm.convert.wan import parity_samples, parity_timesteps, rules
        from dfm.data.packing import pack_samples

        self.reference, self.cfg = tiny_diffusers_wan(), tiny_model_config()
        self.rules = rules(self.cfg)
        self.weights = to_dfm(self.reference.state_dict(), self.rules)
        self.samples, self.t = parity_samples(self.cfg), parity_timesteps(3)
        self.batch = pack_samples(self.samples)

    def dfm(self, model) -> list[torch.Tensor]:
        from dfm.convert.wan import dfm_sample_outputs

        return dfm_sample_outputs(model(self.batch.latents, self.t, self.batch), self.batch, self.cfg)

    def diffusers(self, transformer) -> list[torch.Tensor]:
        from dfm.convert.wan import diffusers_sample_output

        return [diffusers_sample_output(transformer, s, t, TEXT_LEN) for s, t in zip(self.samples, self.t)]

    def pipeline(self, transformer):
        import diffusers

        return diffusers.WanPipeline(
            tokenizer=None, text_encoder=None, vae=None, scheduler=None, transformer=transformer
        )


class Flux:
    """The FLUX family's model, inputs and diffusers run."""

    targets = FLUX_TARGETS

    def __init__(self):
        from dfm.convert.flux import flux_rules, verification_pack

        self.reference = tiny_diffusers_flux()
        cfg, self.weights = dfm_config_and_weights(self.reference)
        self.cfg = cfg.model
        self.rules = flux_rules(self.cfg)
        self.batch, self.t, self.guidance = verification_pack(self.cfg)

    def dfm(self, model) -> list[torch.Tensor]:
        """Each sample's rows [L_i, D] of the packed output."""
        out, host = model(self.batch.latents, self.t, self.batch, self.guidance), self.batch.host_view()
        starts, lengths = host.cu_seqlens_q_padded.tolist(), host.sample_lengths.tolist()
        return [out[start : start + n] for start, n in zip(starts, lengths)]

    def diffusers(self, transformer) -> list[torch.Tensor]:
        from dfm.convert.flux import diffusers_outputs

        return diffusers_outputs(transformer, self.batch, self.t, self.guidance, self.cfg.in_channels)

    def pipeline(self, transformer):
        import diffusers

        return diffusers.FluxPipeline(
            scheduler=None,
            vae=None,
            text_encoder=None,
            tokenizer=None,
            text_encoder_2=None,
            tokenizer_2=None,
            transformer=transformer,
        )


def max_diff(outputs, references) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(outputs, references))


def train_adapters(family, model, steps: int = 2) -> None:
    """A few Adam steps on a squared-output loss: only the adapters may change."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    for _ in range(steps):
        loss = sum(o.square().mean() for o in family.dfm(model))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.fixture(scope="module", params=[Wan, Flux], ids=["wan", "flux"])
def trained(request, dist, tmp_path_factory):  # noqa: F811
    """(family, peft, base output, output with zero-B adapters, trained model, LoRA file)."""
    family = request.param()
    peft = PeftConfig(lora_rank=4, lora_alpha=8.0, target_modules=family.targets)
    model, _ = empty_model(family.cfg, "fp32")
    fill_weights(model, family.weights, "the tiny weights")
    with torch.no_grad():
        base = family.dfm(model)
        add_lora(model, peft, family.cfg, family.rules, seed=0)
        zero = family.dfm(model)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    train_adapters(family, model)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    weights = {model.global_param_name(n): p.detach() for n, p in model.named_parameters()}
    state = lora_state_dict(weights, family.cfg, peft, family.rules)
    path = tmp_path_factory.mktemp("lora") / "pytorch_lora_weights.safetensors"
    save_file(state, str(path), metadata=lora_metadata(state, peft))
    return family, peft, base, zero, model, weights, path


def test_zero_b_adapters_leave_the_output_unchanged(trained):
    family, _, base, zero, *_ = trained
    assert all(torch.equal(a, b) for a, b in zip(base, zero))


@torch.no_grad()
def test_trained_lora_equals_diffusers_with_the_exported_file_loaded(trained):
    family, _, _, _, model, _, path = trained
    dfm_out = family.dfm(model)
    pipeline = family.pipeline(family.reference)
    pipeline.load_lora_weights(str(path))
    loaded = family.diffusers(pipeline.transformer)
    assert max_diff(dfm_out, loaded) <= TOLERANCE
    pipeline.transformer.disable_lora()
    assert max_diff(dfm_out, family.diffusers(pipeline.transformer)) > 100 * TOLERANCE  # the LoRA matters
    pipeline.transformer.enable_lora()


@torch.no_grad()
def test_merged_export_equals_the_lora_loaded_diffusers_model(trained):
    family, peft, _, _, model, weights, path = trained
    merged = to_diffusers(merged_weights(weights, family.cfg, peft, family.rules), family.rules)
    plain = type(family.reference).from_config(family.reference.config).eval()
    plain.load_state_dict(merged)
    pipeline = family.pipeline(family.reference)
    if not pipeline.transformer.peft_config:
        pipeline.load_lora_weights(str(path))
    assert max_diff(family.diffusers(plain), family.diffusers(pipeline.transformer)) <= TOLERANCE
