"""DMD2's GAN loss (dfm/distill/dmd2.py, dfm/models/common/sample_classifier.py): the classifier reads each
packed sample as it would alone, its losses are the logistic ones written out, the student's loss reaches
the student's samples and not the critic's weights. The training runs with it (resume, layouts) are in
test_distill_run.py and test_distill_layouts.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dfm.diffusion import FlowPipeline, FlowSettings
from dfm.distill import DistillSettings, Packing, classifier_logits, gan_critic_loss, gan_student_loss
from dfm.models.common.sample_classifier import SampleClassifier, is_classifier_param, per_sample_mean

H = 8
# Three samples of 3, 2 and 4 tokens; the last token of samples 0 and 2 is padding.
SAMPLE_IDS = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
LOSS_MASK = torch.tensor([1, 1, 0, 1, 1, 1, 1, 1, 0], dtype=torch.float32)
PACKING = Packing(SAMPLE_IDS, LOSS_MASK, 3)


def features(seed: int = 0) -> torch.Tensor:
    """[9, H] with NaN on the padding tokens: nothing may read them."""
    values = torch.randn(9, H, generator=torch.Generator().manual_seed(seed))
    return torch.where(LOSS_MASK[:, None] > 0, values, torch.full_like(values, float("nan")))


def classifier() -> SampleClassifier:
    torch.manual_seed(0)
    return SampleClassifier(H)


def test_pooling_is_each_samples_mean_over_its_real_tokens():
    x = features()
    pooled = per_sample_mean(x, SAMPLE_IDS, LOSS_MASK, 3)
    expected = torch.stack([x[0:2].mean(0), x[3:5].mean(0), x[5:8].mean(0)])
    torch.testing.assert_close(pooled, expected)


def test_a_packed_sample_gets_the_logit_it_gets_alone():
    head, x = classifier(), features()
    packed = head(x, SAMPLE_IDS, LOSS_MASK, 3)
    alone = [
        head(x[start:stop], torch.zeros(stop - start, dtype=torch.long), torch.ones(stop - start), 1)
        for start, stop in ((0, 2), (3, 5), (5, 8))
    ]
    torch.testing.assert_close(packed, torch.cat(alone))
    assert packed.dtype == torch.float32 and torch.isfinite(packed).all()


def test_classifier_parameters_are_named_for_the_checkpoint_filter():
    names = [f"module.gan_classifier.{name}" for name, _ in classifier().named_parameters()]
    assert names and all(is_classifier_param(name) for name in names)
    assert not is_classifier_param("module.final_layer.linear.weight")


class TinyCritic(torch.nn.Module):
    """Called as dfm calls a model: (x_in [S, D], c_noise [N], batch=..., classify=...) -> logits [N]."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(3, H)
        self.head = classifier()
        self.seen = []

    def forward(self, x_in, c_noise, classify=False, **cond):
        assert classify
        self.seen.append(c_noise)
        return self.head(self.embed(x_in), SAMPLE_IDS, LOSS_MASK, 3)


def test_the_discriminator_loss_is_the_logistic_loss():
    fake, real = torch.tensor([0.0, 2.0, -1.0]), torch.tensor([0.0, 1.0, -3.0])
    expected = [math.log1p(math.exp(-r)) + math.log1p(math.exp(f)) for f, r in zip(fake.tolist(), real.tolist())]
    torch.testing.assert_close(gan_critic_loss(fake, real), torch.tensor(expected))
    assert gan_critic_loss(torch.zeros(1), torch.zeros(1)).item() == pytest.approx(2 * math.log(2))


def test_classifier_logits_read_the_sample_renoised_in_the_critics_range():
    critic, settings = TinyCritic(), DistillSettings(min_t=0.3, max_t=0.4)
    pipe = FlowPipeline(FlowSettings())
    logits = classifier_logits(
        pipe, critic, torch.randn(9, 3), PACKING, settings, None, torch.Generator().manual_seed(1)
    )
    assert logits.shape == (3,)
    t = critic.seen[0] / pipe.settings.c_noise_scale
    assert ((t >= 0.3) & (t <= 0.4)).all(), t


def test_the_student_loss_reaches_the_samples_and_not_the_critics_weights():
    critic, settings = TinyCritic(), DistillSettings()
    pipe = FlowPipeline(FlowSettings())
    x0 = torch.randn(9, 3, requires_grad=True)
    loss = gan_student_loss(pipe, critic, x0, PACKING, settings, None, torch.Generator().manual_seed(2))
    assert loss.shape == (3,) and (loss > 0).all()
    loss.sum().backward()
    assert x0.grad is not None and x0.grad[LOSS_MASK > 0].abs().sum() > 0
    assert all(p.grad is None for p in critic.parameters())
    assert all(p.requires_grad for p in critic.parameters())  # trainable again after the loss
    # the non-saturating form: softplus(-logit)
    logits = classifier_logits(pipe, critic, x0.detach(), PACKING, settings, None, torch.Generator().manual_seed(2))
    torch.testing.assert_close(loss.detach(), F.softplus(-logits.detach()))


def test_a_grad_share_scales_the_heads_own_gradient_only():
    """Under CP each rank keeps 1 / CP of the head's gradient; the logits and the features' gradient stay."""
    grads = []
    for share in (1.0, 0.25):
        head, x = classifier(), features().nan_to_num().requires_grad_()
        logits = head(x, SAMPLE_IDS, LOSS_MASK, 3, grad_share=share)
        logits.sum().backward()
        grads.append((logits.detach(), x.grad, [p.grad for p in head.parameters()]))
    (logits_1, x_1, params_1), (logits_q, x_q, params_q) = grads
    torch.testing.assert_close(logits_q, logits_1)
    torch.testing.assert_close(x_q, x_1)
    for whole, share in zip(params_1, params_q):
        torch.testing.assert_close(share, whole * 0.25)
