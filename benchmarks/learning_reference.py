"""A plain PyTorch video DiT trained on the moving-digits shards: the reference dfm's learning is compared
against (benchmarks/learning_parity.py, issue #44).

Written the way a researcher would: the shards read with ``tarfile`` into dense tensors (no dfm loader),
the model ``benchmarks.reference_dit.ReferenceDiT`` with DiT's adaLN-Zero initialisation, dense
``[B, L, patch_dim]`` batches of whole clips, captions zero-padded and masked in cross-attention, a
hand-written flow-matching step and Euler sampler. What it shares with dfm is the inputs and the
verdict: the same shards (latents and T5 embeddings), the same hyper-parameters (read from the same
config), the same starting noise and T5 / VAE for sampling, and the digits scorer.

The objective is dfm's flow pipeline (dfm/diffusion/flow.py), written out here:

    t ~ sigmoid(N(logit_mean, logit_std^2)), then t' = shift t / (1 + (shift - 1) t)
    x_t = (1 - t) x0 + (sigma_min + (1 - sigma_min) t) n,   v = (1 - sigma_min) n - x0,   loss = |v_hat - v|^2
    the net sees c_noise = c_noise_scale * t; a caption is zeroed (the null text) with probability cfg_dropout_prob
"""

from __future__ import annotations

import io
import itertools
import json
import math
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from braceexpand import braceexpand
from einops import rearrange
from torch import Tensor, nn

from benchmarks.reference_dit import ReferenceDiT
from dfm.diffusion.flow import FlowSettings
from dfm.inference.encoders import EncoderSources, load_encoders
from dfm.safe_unpickle import array_globals, restricted_loads

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples/megatron/recipes/dit"))  # `digits` lives there

from digits.evaluate import (
    DigitSampling,
    caption_embeddings,
    clip_prompts,
    latents_to_pixels,
    prompt_noises,
    score_samples,
)


@dataclass
class ClipShards:
    latents: Tensor  # [N, C, T, H, W]
    texts: list[Tensor]  # N x [L_i, D] T5 embeddings, unpadded
    captions: list[str]


def read_clip_shards(dataset_dir: Path) -> ClipShards:
    """Every sample of the energon dataset's train split (its ``split.yaml``), read straight from the tars."""
    split = yaml.safe_load((dataset_dir / ".nv-meta" / "split.yaml").read_text())
    parts: dict[str, dict[str, bytes]] = {}
    # energon writes a run of shards as one brace pattern ("rank000-{000000..000003}.tar")
    for shard in (name for pattern in split["split_parts"]["train"] for name in braceexpand(pattern)):
        with tarfile.open(dataset_dir / shard) as tar:
            for member in filter(tarfile.TarInfo.isfile, tar):
                key, extension = member.name.split(".", 1)
                parts.setdefault(f"{shard}/{key}", {})[extension] = tar.extractfile(member).read()
    samples = [parts[key] for key in sorted(parts)]
    return ClipShards(
        torch.stack([torch.load(io.BytesIO(s["pth"]), weights_only=True) for s in samples]),
        [torch.as_tensor(restricted_loads(s["pickle"], array_globals(), "shard text")) for s in samples],
        [json.loads(s["json"])["caption"] for s in samples],
    )


def to_tokens(latents: Tensor, pt: int, ps: int) -> tuple[Tensor, Tensor]:
    """[B, C, T, H, W] -> (tokens [B, L, pt*ps*ps*C], (t, h, w) patch coordinates [L, 3])."""
    _, _, t, h, w = latents.shape
    tokens = rearrange(latents, "b c (t i) (h j) (w k) -> b (t h w) (i j k c)", i=pt, j=ps, k=ps)
    grid = torch.cartesian_prod(torch.arange(t // pt), torch.arange(h // ps), torch.arange(w // ps))
    return tokens, grid


def from_tokens(tokens: Tensor, shape: tuple[int, ...], pt: int, ps: int) -> Tensor:
    """tokens [B, L, pt*ps*ps*C] -> latents [B, *shape] with shape (C, T, H, W)."""
    c, t, h, w = shape
    return rearrange(tokens, "b (t h w) (i j k c) -> b c (t i) (h j) (w k)", t=t // pt, h=h // ps, i=pt, j=ps, c=c)


def padded_texts(texts: list[Tensor]) -> tuple[Tensor, Tensor]:
    """N x [L_i, D] -> (zero-padded [N, L, D], attention mask [N, 1, 1, L], True = a real token)."""
    lengths = torch.tensor([len(t) for t in texts])
    mask = torch.arange(int(lengths.max()))[None] < lengths[:, None]
    return nn.utils.rnn.pad_sequence(texts, batch_first=True).float(), mask[:, None, None]


def adaln_zero_init(model: ReferenceDiT) -> ReferenceDiT:
    """DiT's initialisation: Xavier-uniform linears with zero biases, N(0, 0.02) timestep MLP, and zero
    adaLN modulations and output layer, so every block starts as the identity and the output at 0."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    for layer in (model.t_embedder[0], model.t_embedder[2]):
        nn.init.normal_(layer.weight, std=0.02)
    for layer in [b.adaLN_modulation[-1] for b in model.blocks] + [model.final_adaLN[-1], model.final_linear]:
        nn.init.zeros_(layer.weight)
        nn.init.zeros_(layer.bias)
    return model


# --- the flow-matching objective (dfm/diffusion/flow.py's, written out) ---------------------------------


def training_times(n: int, flow: FlowSettings, generator: torch.Generator) -> Tensor:
    """[n] times: logit-normal (or uniform) draws, then the SD3 shift."""
    unsupported = flow.uniform_mix or flow.dynamic_shift or (flow.t_min, flow.t_max) != (0.0, 1.0)
    if unsupported:
        raise ValueError("the reference draws t without uniform_mix, dynamic_shift or t_min / t_max")
    if flow.timestep_sampling == "uniform":
        t = torch.rand(n, generator=generator)
    else:
        t = torch.sigmoid(flow.logit_mean + flow.logit_std * torch.randn(n, generator=generator))
    return flow.shift * t / (1 + (flow.shift - 1) * t)


def noised(x0: Tensor, noise: Tensor, t: Tensor, sigma_min: float) -> Tensor:
    """x_t = (1 - t) x0 + (sigma_min + (1 - sigma_min) t) n; x0, noise [B, ...], t [B]."""
    t = t.view(-1, *[1] * (x0.dim() - 1))
    return (1 - t) * x0 + (sigma_min + (1 - sigma_min) * t) * noise


def velocity_target(x0: Tensor, noise: Tensor, sigma_min: float) -> Tensor:
    return (1 - sigma_min) * noise - x0


# --- training and sampling -------------------------------------------------------------------------------


@dataclass
class ReferenceRun:
    model: ReferenceDiT
    losses: list[tuple[int, float]]  # (iteration from 1, loss)
    seconds: float
    snapshots: dict[int, dict[str, Tensor]] = field(default_factory=dict)  # iteration -> weights (a curve)


def lr_factor(scheduler, lr: float, min_lr: float, train_iters: int):
    """The config's schedule as a multiple of ``lr`` per update: a linear warm-up from 0 over
    ``lr_warmup_iters``, then constant, or a cosine from ``lr`` to ``min_lr`` over the decay iterations
    (megatron's formula)."""
    warmup, decay = scheduler.lr_warmup_iters, scheduler.decay_iters(train_iters)

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if scheduler.lr_decay_style == "constant":
            return 1.0
        ratio = min(1.0, (step - warmup) / max(1, decay - warmup))
        return (min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (lr - min_lr)) / lr

    return factor


def train_reference(shards: ClipShards, cfg, batch_size: int, seed: int, snapshot_every: int = 0) -> ReferenceRun:
    """``cfg.train.train_iters`` AdamW steps on random batches of ``batch_size`` whole clips (an epoch-wise
    shuffle), with the config's optimizer, schedule, clipping, cfg dropout and flow settings; with
    ``snapshot_every``, a copy of the weights every that many iterations (as dfm saves checkpoints)."""
    if cfg.scheduler.lr_decay_style not in ("constant", "cosine") or cfg.optimizer.optimizer != "adam":
        raise ValueError("the reference runs Adam(W) with a constant or cosine rate after warm-up")
    start = time.perf_counter()
    torch.manual_seed(seed)
    model, o, m = adaln_zero_init(ReferenceDiT(cfg.model)), cfg.optimizer, cfg.model
    # dfm's (megatron's) Adam decouples weight decay: AdamW, here with the config's decay (0 in the recipe).
    optimizer = torch.optim.AdamW(
        model.parameters(), o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, weight_decay=o.weight_decay
    )
    factor = lr_factor(cfg.scheduler, o.lr, o.min_lr, cfg.train.train_iters)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    tokens, pos_ids = to_tokens(shards.latents.float(), m.patch_temporal, m.patch_spatial)
    text, mask = padded_texts(shards.texts)
    generator = torch.Generator().manual_seed(seed)
    order, losses, snapshots = torch.empty(0, dtype=torch.long), [], {}
    for iteration in range(1, cfg.train.train_iters + 1):
        if len(order) < batch_size:
            order = torch.cat([order, torch.randperm(len(tokens), generator=generator)])
        rows, order = order[:batch_size], order[batch_size:]
        x0 = tokens[rows]
        noise = torch.randn(x0.shape, generator=generator)
        t = training_times(len(rows), cfg.flow, generator)
        kept = torch.rand(len(rows), generator=generator) >= cfg.dataset.cfg_dropout_prob
        context = text[rows] * kept[:, None, None]  # a dropped caption is the null (zero) text
        x_t = noised(x0, noise, t, cfg.flow.sigma_min)
        prediction = model(x_t, cfg.flow.c_noise_scale * t, pos_ids, context, mask[rows])
        loss = F.mse_loss(prediction, velocity_target(x0, noise, cfg.flow.sigma_min))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
        optimizer.step()
        schedule.step()
        losses.append((iteration, loss.item()))
        if iteration % 100 == 0:  # a long CPU run shows it is alive
            print(f"reference iter {iteration}/{cfg.train.train_iters} | loss {loss.item():.4f}", flush=True)
        if snapshot_every and iteration % snapshot_every == 0 and iteration < cfg.train.train_iters:
            snapshots[iteration] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return ReferenceRun(model, losses, time.perf_counter() - start, snapshots)


@torch.no_grad()
def euler_sample(
    model: ReferenceDiT, x: Tensor, pos_ids: Tensor, caption: tuple[Tensor, Tensor], cfg, steps: int, guidance: float
) -> Tensor:
    """Integrate dx/dt = v from t = 1 (x: noise tokens [B, L, D]) to 0 over the shifted uniform schedule;
    ``caption``: padded text [B, Lt, Dt] and its mask (``padded_texts``). Classifier-free guidance
    v_u + s (v_c - v_u) against the zeroed text, skipped at s = 1."""
    flow, (text, mask) = cfg.flow, caption
    times = [flow.shift * t / (1 + (flow.shift - 1) * t) for t in (1 - i / steps for i in range(steps + 1))]
    for t, t_next in itertools.pairwise(times):
        c_noise = torch.full((len(x),), flow.c_noise_scale * t)
        v = model(x, c_noise, pos_ids, text, mask)
        if guidance != 1.0:
            v_null = model(x, c_noise, pos_ids, torch.zeros_like(text), mask)
            v = v_null + guidance * (v - v_null)
        x = x + (t_next - t) * v
    return x


def score_reference(model: ReferenceDiT, root: Path, cfg, sampling: DigitSampling) -> dict:
    """digits.evaluate's scores of the reference: its prompts, starting noise, T5, VAE and scorer, sampled
    conditionally (with guidance) and unconditionally (null text) by ``euler_sample``."""
    if sampling.sampler not in (None, "euler"):
        raise ValueError(f"the reference samples with flow Euler only, not {sampling.sampler!r}")
    sources = EncoderSources(t5=str(root / "t5"), vae=str(root / "vae"), vae_subfolder=None)
    encoders = load_encoders(sources, cfg.model.max_text_len, torch.device("cpu"))
    prompts = clip_prompts(sampling)
    embeddings = caption_embeddings(encoders, prompts.captions)
    text, mask = padded_texts([embeddings[c].float().cpu() for c in prompts.captions])
    m = cfg.model
    shape = (m.in_channels, *m.max_latent_thw)
    noise = torch.stack(prompt_noises(shape, len(prompts.captions), sampling))
    tokens, pos_ids = to_tokens(noise, m.patch_temporal, m.patch_spatial)
    model.eval()
    pixels = []
    for context, guidance in ((text, sampling.guidance_scale), (torch.zeros_like(text), 1.0)):
        clean = euler_sample(model, tokens, pos_ids, (context, mask), cfg, sampling.steps, guidance)
        pixels.append(latents_to_pixels(encoders, from_tokens(clean, shape, m.patch_temporal, m.patch_spatial)))
    return score_samples(prompts, *pixels)
