"""DMD2's GAN head: one real / fake logit per sample, read from a network's last hidden states.

The critic of a distillation with ``distill.gan_critic_weight`` > 0 carries one (docs/distillation.md,
"The GAN loss"). It pools the latent tokens' last hidden states per sample (a mean over the sample's real
tokens: packed samples of any size give one vector each), then LayerNorm -> Linear -> SiLU -> Linear.
Its parameters sit under ``gan_classifier.`` in the critic's checkpoint; a teacher's has none, so they
keep their initialisation when the critic starts from the teacher.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dfm.diffusion.packed_loss import masked_sums_per_sample
from dfm.models.common.init import init_params

CLASSIFIER = "gan_classifier"  # the attribute (and state-dict prefix) of the head on a model


def is_classifier_param(name: str) -> bool:
    """A GAN classifier's parameter (or state-dict key), by name."""
    return f".{CLASSIFIER}." in f".{name}"


class SampleClassifier(nn.Module):
    """features [S, h] of a pack's latent tokens -> logits [N] fp32 (real > 0 > fake)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.norm = nn.LayerNorm(hidden_size, eps=eps)
        self.fc1 = nn.Linear(hidden_size, hidden_size)
        self.fc2 = nn.Linear(hidden_size, 1)

    def forward(
        self, features: Tensor, sample_ids: Tensor, loss_mask: Tensor, num_samples: int, grad_share: float = 1.0
    ) -> Tensor:
        """``grad_share``: the part of its own parameters' gradient this rank keeps. Under context parallelism
        every CP rank runs the head on the whole pack (gathered features) and gets its whole gradient, while
        megatron sums the ranks' gradients over CP (each holds its own tokens' part of the trunk's): each
        keeps 1 / CP of the head's."""
        pooled = per_sample_mean(features, sample_ids, loss_mask, num_samples).to(self.fc1.weight.dtype)
        norm, fc1, fc2 = (
            {name: shared_grad(param, grad_share) for name, param in layer.named_parameters()}
            for layer in (self.norm, self.fc1, self.fc2)
        )
        hidden = F.layer_norm(pooled, pooled.shape[-1:], norm["weight"], norm["bias"], self.norm.eps)
        hidden = F.silu(F.linear(hidden, fc1["weight"], fc1["bias"]))
        return F.linear(hidden, fc2["weight"], fc2["bias"])[:, 0].float()


class _GradShare(torch.autograd.Function):
    """Identity forward; the gradient times ``share`` backward."""

    @staticmethod
    def forward(ctx, tensor: Tensor, share: float) -> Tensor:
        ctx.share = share
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.share, None


def shared_grad(tensor: Tensor, share: float) -> Tensor:
    """``tensor`` itself when ``share`` is 1; else a view whose gradient reaches it times ``share``."""
    return tensor if share == 1.0 else _GradShare.apply(tensor, share)


def per_sample_mean(features: Tensor, sample_ids: Tensor, loss_mask: Tensor, num_samples: int) -> Tensor:
    """[S, h] -> [N, h] fp32: each sample's mean over its real tokens (padding ignored, NaN there included)."""
    sums, real_tokens = masked_sums_per_sample(features.float(), sample_ids, loss_mask, num_samples)
    return sums / real_tokens.clamp_min(1.0)[:, None]


def add_classifier(model: nn.Module, seed: int, std: float) -> nn.Module:
    """``model`` (unwrapped) with a ``SampleClassifier`` of its width, on its parameters' device and dtype.
    Materialised, it is drawn as every dfm parameter is, from (seed, its global name) (init.py): the same on
    every rank and layout; on the meta device it is left for Megatron-FSDP's sharded init to draw alike."""
    reference = next(model.parameters())
    head = SampleClassifier(model.config.hidden_size, model.config.layernorm_epsilon)
    head = head.to(device=reference.device, dtype=reference.dtype)
    if reference.device.type != "meta":
        init_params(head, seed, lambda name: model.global_param_name(f"{CLASSIFIER}.{name}"), std)
    setattr(model, CLASSIFIER, head)
    return model
