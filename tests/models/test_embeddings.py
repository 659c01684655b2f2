"""3D RoPE (relative-position scores), absolute 3D embeddings, timestep embedding, patchify."""

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from dfm.data.patchify import num_tokens, patch_grid, patchify, unpatchify
from dfm.models.common.embeddings import (
    FactorizedLearned3DEmbedding,
    SincosTable,
    TimestepEmbedder,
    rope_3d_freqs,
    sincos_3d,
    split_head_dim_3d,
)

HEAD_DIM = 24


def rotate(x: torch.Tensor, pos_ids: torch.Tensor) -> torch.Tensor:
    """x [S, head_dim] rotated at pos_ids [S, 3] by the same megatron kernel the model uses."""
    freqs = rope_3d_freqs(pos_ids, x.shape[-1]).double()
    return _apply_rotary_pos_emb_bshd(x[:, None, None, :], freqs)[:, 0, 0]


def random_positions(count: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 12, (count, 3), generator=gen)


def test_rope_scores_depend_only_on_relative_positions():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 10, HEAD_DIM, generator=gen, dtype=torch.double)
    pos_q, pos_k = random_positions(10, gen), random_positions(10, gen)
    scores = rotate(q, pos_q) @ rotate(k, pos_k).T
    for shift in ([3, 0, 0], [0, 5, 0], [0, 0, 7], [2, -4, 9]):
        shift = torch.tensor(shift)
        shifted = rotate(q, pos_q + shift) @ rotate(k, pos_k + shift).T
        torch.testing.assert_close(shifted, scores, atol=1e-5, rtol=1e-5)  # angles are fp32


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_rope_sees_every_axis(axis):
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 1, HEAD_DIM, generator=gen, dtype=torch.double)
    origin = torch.zeros(1, 3, dtype=torch.long)
    moved = origin.clone()
    moved[0, axis] = 1
    assert not torch.allclose(rotate(q, origin) @ rotate(k, origin).T, rotate(q, origin) @ rotate(k, moved).T)


def test_head_dim_split_is_even_and_complete():
    for head_dim in (8, 24, 64, 72, 128):
        dims = split_head_dim_3d(head_dim)
        assert sum(dims) == head_dim and all(d % 2 == 0 for d in dims)
    with pytest.raises(ValueError, match="even"):
        split_head_dim_3d(7)


def test_sincos_3d_is_fixed_and_distinguishes_positions():
    pos = patch_grid(2, 3, 4)
    emb = sincos_3d(pos, 48)
    assert emb.shape == (24, 48)
    assert torch.equal(emb, sincos_3d(pos, 48))
    assert torch.cdist(emb, emb).add(torch.eye(24)).min() > 0  # no two positions collide


def test_sincos_table_is_kept_while_the_positions_stay():
    table = SincosTable()
    pos = patch_grid(2, 3, 4)
    first = table(pos, pos.clone(), 48)
    assert torch.equal(first, sincos_3d(pos, 48))
    assert table(pos.clone(), pos.clone(), 48) is first  # the next pack laid out alike: kept
    other = patch_grid(2, 4, 3)
    assert torch.equal(table(other, other, 48), sincos_3d(other, 48))  # other positions: made again
    assert torch.equal(table(other, other, 24), sincos_3d(other, 24))  # another width too
    longer = patch_grid(3, 4, 3)
    assert torch.equal(table(longer, longer, 24), sincos_3d(longer, 24))


def test_learned_3d_is_a_sum_of_per_axis_tables_and_checks_limits():
    table = FactorizedLearned3DEmbedding((2, 3, 4), 8)
    pos = patch_grid(2, 3, 4)
    expected = table.tables[0].weight[pos[:, 0]] + table.tables[1].weight[pos[:, 1]] + table.tables[2].weight[pos[:, 2]]
    torch.testing.assert_close(table(pos), expected)
    with pytest.raises(ValueError, match="axis h"):
        table(torch.tensor([[0, 3, 0]]))


def test_timestep_embedding_shape_and_sensitivity():
    embedder = TimestepEmbedder(32)
    out = embedder(torch.tensor([0.1, 0.1, 0.7]))
    assert out.shape == (3, 32)
    assert torch.equal(out[0], out[1]) and not torch.allclose(out[0], out[2])


@pytest.mark.parametrize("shape,pt,ps", [((4, 1, 8, 6), 1, 2), ((3, 4, 4, 8), 2, 2), ((2, 6, 3, 3), 3, 1)])
def test_patchify_roundtrip_with_separate_temporal_and_spatial_patches(shape, pt, ps):
    latent = torch.randn(shape)
    tokens, pos = patchify(latent, pt, ps)
    c, t, h, w = shape
    assert tokens.shape == (num_tokens(shape, pt, ps), c * pt * ps * ps)
    assert torch.equal(pos.max(0).values, torch.tensor([t // pt - 1, h // ps - 1, w // ps - 1]))
    assert torch.equal(unpatchify(tokens, shape, pt, ps), latent)
    # each token at (t, h, w) holds exactly that patch of the latent, features (pt, ph, pw, c)
    for token, (tt, hh, ww) in zip(tokens, pos.tolist(), strict=True):
        patch = latent[:, tt * pt : (tt + 1) * pt, hh * ps : (hh + 1) * ps, ww * ps : (ww + 1) * ps]
        assert torch.equal(token, patch.permute(1, 2, 3, 0).reshape(-1))


def test_patchify_names_the_size_a_patch_does_not_divide():
    with pytest.raises(ValueError, match="latent T=3"):
        patchify(torch.randn(4, 3, 8, 8), 2, 2)
