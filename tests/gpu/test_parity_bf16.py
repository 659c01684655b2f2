"""Wan, FLUX and HunyuanVideo 1.5 in bf16 on the device against diffusers in bf16, tiny random models built here.

Both bf16 runs (dfm's and diffusers') are compared with diffusers in fp32 on the same device and the
same inputs (rounded to bf16 once, so input rounding is no one's error): dfm passes when

    max |dfm_bf16 - diffusers_fp32| <= 2 * max |diffusers_bf16 - diffusers_fp32| + 2^-8 * max |diffusers_fp32|

Why this tolerance: bf16's error is the model's own (rounding after every matmul, norm and
activation), and diffusers' bf16 run measures it for this very model and input. dfm computes the
same function in another order (fused QKV, packed attention, its own norm kernels), so its rounding
differs but should be of the same size: a factor 2 allows that; the floor (one bf16 ulp at the
output's scale) covers a diffusers run that happens to round very little. A wrong formula, a missed
cast (fp32 params left in bf16 math, or bf16 where diffusers upcasts) or a mis-masked pack gives
errors of the order of the outputs themselves. The fp32 equality itself (<= 1e-5) is proven on the
CPU by tests/wan/test_wan_parity.py and tests/flux/test_flux_model.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dfm.convert import hunyuan
from dfm.convert.flux import diffusers_outputs, verification_pack
from dfm.convert.wan import (
    dfm_sample_outputs,
    diffusers_sample_output,
    max_abs_diff,
    parity_samples,
    parity_timesteps,
)
from dfm.convert.weights import single_process_world
from dfm.data.packing import pack_samples
from tests._parity import converted_model
from tests.flux._tiny import dfm_config_and_weights, tiny_diffusers_flux
from tests.gpu._device import DEVICE, cuda_only, gpu_test
from tests.hunyuan._tiny import dfm_config_and_weights as hunyuan_config_and_weights
from tests.hunyuan._tiny import tiny_diffusers_hunyuan
from tests.wan._tiny import TEXT_LEN, TINY, dfm_wan_of, tiny_diffusers_wan, tiny_model_config

# The parity tests need the device; the tolerance's own test is plain arithmetic and runs everywhere.

FACTOR, FLOOR = 2.0, 2.0**-8
# Head dim 16, a multiple of 8 as the flash kernels take (12, TINY's, is padded for them: tested in
# tests/models/test_packed_attention.py).
WAN = {**TINY, "attention_head_dim": 16}
BACKENDS = ["sdpa", pytest.param("varlen", marks=cuda_only), "flex"]


@pytest.fixture(autouse=True)
def true_fp32():
    """fp32 references in full fp32: no TF32 matmuls."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def rounded(tensor: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """On the device, rounded to bf16 once, held in ``dtype``."""
    return tensor.to(DEVICE).to(torch.bfloat16).to(dtype)


def assert_bf16_parity(ours: float, theirs: float, scale: float) -> None:
    """Errors against diffusers fp32: dfm's bf16 ``ours``, diffusers' bf16 ``theirs``; ``scale`` the outputs' max."""
    print(f"bf16 error vs diffusers fp32: dfm {ours:.3e}, diffusers {theirs:.3e} (outputs' max {scale:.3f})")
    assert scale > 0.1, "the reference output is (nearly) zero: nothing compared"
    assert ours <= FACTOR * theirs + FLOOR * scale, f"dfm bf16 error {ours:.3e}, diffusers bf16 {theirs:.3e}"


def wan_samples(cfg, dtype: torch.dtype):
    """parity_samples on the device, latents and text rounded to bf16 and held in ``dtype``."""
    return [
        dataclasses.replace(
            s, tokens=rounded(s.tokens, dtype), text=rounded(s.text, dtype), pos_ids=s.pos_ids.to(DEVICE)
        )
        for s in parity_samples(cfg)
    ]


@gpu_test
@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_wan_bf16_matches_diffusers_bf16(dist, backend):
    transformer = tiny_diffusers_wan(config=WAN)
    cfg = tiny_model_config(WAN, attention_backend=backend)
    model = dfm_wan_of(transformer, cfg, "bf16").to(DEVICE, torch.bfloat16)  # as training builds and casts it
    timesteps = parity_timesteps(3).to(DEVICE)

    def run_diffusers(dtype):
        transformer.to(DEVICE, dtype)
        pairs = zip(wan_samples(cfg, dtype), timesteps)
        return [diffusers_sample_output(transformer, s, t, TEXT_LEN).float() for s, t in pairs]

    references, theirs = run_diffusers(torch.float32), run_diffusers(torch.bfloat16)
    batch = pack_samples(wan_samples(cfg, torch.float32), segment_multiple=4).to(DEVICE)
    ours = dfm_sample_outputs(model(batch.latents, timesteps, batch).float(), batch, cfg)
    scale = max(float(r.abs().max()) for r in references)
    assert_bf16_parity(max_abs_diff(ours, references), max_abs_diff(theirs, references), scale)


def rounded_floats(batch, dtype: torch.dtype):
    """``batch`` on the device, its floating tensors rounded to bf16 once and held in ``dtype``."""
    batch = batch.to(DEVICE)
    floats = {
        f.name: rounded(value, dtype)
        for f in dataclasses.fields(batch)
        if isinstance(value := getattr(batch, f.name), torch.Tensor) and value.is_floating_point()
    }
    return dataclasses.replace(batch, **floats)


def assert_packed_bf16_parity(cfg, weights: dict, batch, inputs: tuple, references: list, theirs: list) -> None:
    """dfm's bf16 model of ``cfg`` holding ``weights`` run on ``inputs`` (``batch``'s); each sample's rows
    against diffusers' fp32 ``references``, with diffusers' own bf16 outputs ``theirs`` setting the bound."""
    with single_process_world(cfg.rng.seed):
        model = converted_model(cfg, weights, "bf16").eval().to(DEVICE, torch.bfloat16)
        packed = model(*inputs).float()
    starts = batch.host_view().cu_seqlens_q_padded.tolist()
    ours = [packed[start : start + r.shape[0]] for start, r in zip(starts, references)]
    scale = max(float(r.abs().max()) for r in references)
    assert_bf16_parity(max_abs_diff(ours, references), max_abs_diff(theirs, references), scale)


def flux_pack(cfg, dtype: torch.dtype):
    """verification_pack on the device, its floating tensors rounded to bf16 and held in ``dtype``."""
    # diffusers multiplies t and the guidance by 1000 in the model's dtype: t = 2^-k and guidance 4 keep
    # them exact in bf16, so its bf16 error is the model's, not a rounded input's.
    t, guidance = torch.tensor([0.5, 0.25, 0.125]), torch.full((3,), 4.0)
    return rounded_floats(verification_pack(cfg.model)[0], dtype), t.to(DEVICE), guidance.to(DEVICE)


@gpu_test
@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_flux_bf16_matches_diffusers_bf16(backend):
    reference = tiny_diffusers_flux()
    cfg, weights = dfm_config_and_weights(reference)
    cfg.model.attention_backend = backend
    channels = cfg.model.in_channels

    def run_diffusers(dtype):
        reference.to(DEVICE, dtype)
        return [out.float() for out in diffusers_outputs(reference, *flux_pack(cfg, dtype), channels)]

    references, theirs = run_diffusers(torch.float32), run_diffusers(torch.bfloat16)
    batch, t, guidance = flux_pack(cfg, torch.float32)
    assert_packed_bf16_parity(cfg, weights, batch, (batch.latents, t, batch, guidance), references, theirs)


@gpu_test
@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_hunyuan_bf16_matches_diffusers_bf16(backend):
    """A mixed pack of text- and image-to-video clips with Qwen and ByT5 captions of their own lengths."""
    reference = tiny_diffusers_hunyuan()
    cfg, weights = hunyuan_config_and_weights(reference)
    cfg.model.attention_backend = backend
    pack, _ = hunyuan.verification_pack(cfg.model)
    # Noise levels exact in bf16: diffusers' pipeline hands the timestep over in the model's dtype.
    c_noise = torch.tensor([512.0, 256.0, 128.0, 64.0, 768.0, 896.0])[: pack.num_samples].to(DEVICE)

    def run_diffusers(dtype):
        reference.to(DEVICE, dtype)
        return [
            out.float() for out in hunyuan.diffusers_outputs(reference, rounded_floats(pack, dtype), c_noise.to(dtype))
        ]

    references, theirs = run_diffusers(torch.float32), run_diffusers(torch.bfloat16)
    batch = rounded_floats(pack, torch.float32)
    assert_packed_bf16_parity(cfg, weights, batch, (batch.latents, c_noise, batch), references, theirs)


def test_the_tolerance_catches_a_wrong_model():
    """A plausible bug (one of three samples' outputs off by 10%) fails the criterion at bf16-sized errors."""
    with pytest.raises(AssertionError):
        assert_bf16_parity(ours=0.1 * 3.0, theirs=0.01, scale=3.0)
    assert_bf16_parity(ours=0.02, theirs=0.01, scale=3.0)
