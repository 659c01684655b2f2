"""dfm/models/common/rebuilt.py: ``through_rebuilt`` (a function keeping its input's sources, not its
input, and rebuilding the input in backward) gives the plain call's outputs and gradients (float64
gradcheck) on views of one rebuilt tensor (FLUX's gathered stream rows), keeps the sources' bytes
and not the input's, and composes with full-layer checkpointing's saved-tensor hooks. The MLP's
recomputed activation: tests/models/test_activation_mlp.py."""

import torch
from torch.utils.checkpoint import checkpoint

from benchmarks.activations import saved_bytes
from dfm.models.common.rebuilt import through_rebuilt
from tests.models.test_lean_block import assert_same_grads, rand

ROWS = torch.tensor([4, 0, 5, 2, 1, 3])  # a permutation, as the joint attention's q_inverse
VALID = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)[:, None, None]


def gathered(joint):
    """Like ``stream_rows``: rows of the joint output [6, 1, 4] in stream order, padding rows 0."""
    return joint[ROWS] * VALID


def projections(joint, weight):
    """Two projections of views of one gathered tensor (the double block's text / image rows)."""
    return through_rebuilt(lambda rows: torch.cat([rows[:2] @ weight, rows[2:] @ weight.T]), gathered, joint)


def test_through_rebuilt_equals_the_plain_call_float64():
    def reference(joint, weight):
        rows = gathered(joint)
        return torch.cat([rows[:2] @ weight, rows[2:] @ weight.T])

    assert_same_grads(projections, reference, (rand(6, 1, 4), rand(4, 4, seed=1)))


def test_through_rebuilt_keeps_the_sources_not_the_input():
    """The joint output is kept anyway (here by exp's backward, as by the attention kernel's): the
    projection's gathered input [6, 1, 4] float64 is not kept beside it."""
    joint, weight = rand(6, 1, 4), rand(4, 4, seed=1)
    holder = torch.nn.ParameterList([weight])
    plain = saved_bytes(holder, lambda: gathered(joint.exp()) @ weight)
    rebuilt = saved_bytes(holder, lambda: through_rebuilt(lambda rows: rows @ weight, gathered, joint.exp()))
    assert plain - rebuilt == 6 * 4 * 8


def test_through_rebuilt_under_checkpointing_gives_the_same_gradients():
    joint, weight = rand(6, 1, 4), rand(4, 4, seed=1)
    grad = torch.randn(6, 1, 4, dtype=torch.float64)
    expected = torch.autograd.grad(projections(joint.sin(), weight), (joint, weight), grad)
    out = checkpoint(lambda j, w: projections(j.sin(), w), joint, weight, use_reentrant=False)
    for got, want in zip(torch.autograd.grad(out, (joint, weight), grad), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
