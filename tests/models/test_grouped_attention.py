"""The CPU ``sdpa`` backend's grouped calls (segment_plan.py, sdpa_cpu.py) against per-segment SDPA,
float64 forward and backward, and gradcheck: equal lengths back to back (one call, q/k/v viewed in
place), equal lengths with padding rows, mixed lengths, captions of different lengths (kv padded and
masked, from the pack's own padding rows when each caption has room for the longest), keys shared by
two query segments (context parallel), b = 2 and a strided input."""

import pytest
import torch

from dfm.models.attention import sdpa_cpu
from dfm.models.attention.sdpa import sdpa_per_segment, sdpa_segment_loop
from dfm.models.attention.segment_plan import plan_segments, segment_plan
from dfm.models.attention.segments import PackedSegments
from tests.models._helpers import segments

SCALE = 0.4
CASES = {
    # name: (q real lengths, q padded lengths, kv real lengths, kv padded lengths)
    "equal": ([4] * 6, [4] * 6, [4] * 6, [4] * 6),
    "equal_padded": ([3] * 5, [4] * 5, [3] * 5, [4] * 5),
    "mixed": ([4, 2, 4, 3, 4, 2], [4, 2, 4, 3, 4, 2], [4, 2, 4, 3, 4, 2], [4, 2, 4, 3, 4, 2]),
    "mixed_padded": ([4, 2, 4, 3, 1], [5, 2, 6, 3, 4], [4, 2, 4, 3, 1], [5, 2, 6, 3, 4]),
    "cross_captions": ([4] * 5, [4] * 5, [2, 5, 1, 3, 5], [2, 5, 1, 3, 5]),
    "cross_padded_captions": ([4, 4, 3, 4], [4, 4, 4, 4], [2, 6, 3, 1], [4, 6, 4, 2]),
    "empty_caption": ([4, 4, 4], [4, 4, 4], [3, 0, 2], [3, 0, 2]),
    # a one-shape pack's captions padded to the longest (packing.py): keys read in place, the last
    # padded further (a layout's total multiple); and one whose last caption lacks the room
    "captions_to_longest": ([4] * 5, [4] * 5, [2, 5, 1, 3, 5], [5, 5, 5, 5, 7]),
    "captions_short_last_room": ([4] * 5, [4] * 5, [2, 5, 1, 5, 3], [5, 5, 5, 5, 3]),
}
# (q start, q length, kv start, kv length): under context parallelism a rank's two query chunks of
# one sample read the same keys; and keys in another order than their queries
SEGMENT_LISTS = {
    "shared_keys": [(0, 3, 0, 5), (4, 3, 0, 5), (7, 2, 5, 2), (9, 2, 7, 3)],
    "keys_out_of_order": [(0, 3, 7, 3), (4, 3, 0, 3), (7, 2, 3, 2)],
}


def rand(*shape, seed=0, requires_grad=True):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64, generator=gen).requires_grad_(requires_grad)


def inputs_for(case, heads=2, head_dim=4, batch=1):
    q_lens, q_padded, kv_lens, kv_padded = CASES[case]
    return (
        rand(sum(q_padded), batch, heads, head_dim),
        rand(sum(kv_padded), batch, heads, head_dim, seed=1),
        rand(sum(kv_padded), batch, heads, head_dim, seed=2),
    ), segments(q_lens, q_padded, kv_lens, kv_padded, kind=PackedSegments)


def assert_same_forward_backward(got_fn, want_fn, inputs):
    got, want = got_fn(*inputs), want_fn(*inputs)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, inputs, grad), torch.autograd.grad(want, inputs, grad)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_equals_per_segment_sdpa(case):
    inputs, params = inputs_for(case)
    assert_same_forward_backward(
        lambda *t: sdpa_per_segment(*t, params, SCALE), lambda *t: sdpa_segment_loop(*t, params, SCALE), inputs
    )
    small = [t.detach()[..., :1, :2].clone().requires_grad_() for t in inputs]  # 1 head of dim 2: fewer probes
    assert torch.autograd.gradcheck(lambda *t: sdpa_per_segment(*t, params, SCALE), small)


@pytest.mark.parametrize("case", list(CASES))
def test_padding_rows_stay_zero(case):
    (query, key, value), params = inputs_for(case)
    out = sdpa_per_segment(query, key, value, params, SCALE)
    q_lens, q_padded, kv_lens, _ = CASES[case]
    start = 0
    for length, padded, kv_length in zip(q_lens, q_padded, kv_lens):
        assert not out[start + (length if kv_length else 0) : start + padded].any()
        start += padded


@pytest.mark.parametrize("name", list(SEGMENT_LISTS))
def test_segments_given_as_a_list(name):
    inputs = (rand(11, 1, 2, 4), rand(10, 1, 2, 4, seed=1), rand(10, 1, 2, 4, seed=2))

    def per_segment(query, key, value):
        out = torch.zeros_like(query)
        for q0, nq, k0, nk in SEGMENT_LISTS[name]:
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query[q0 : q0 + nq], key[k0 : k0 + nk], value[k0 : k0 + nk]))
            out[q0 : q0 + nq] = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=SCALE).permute(
                2, 0, 1, 3
            )
        return out

    grouped = lambda *t: sdpa_cpu.segment_attention_cpu(*t, SEGMENT_LISTS[name], SCALE)  # noqa: E731
    assert_same_forward_backward(grouped, per_segment, inputs)
    assert torch.autograd.gradcheck(grouped, [t.detach()[..., :1, :2].clone().requires_grad_() for t in inputs])


@pytest.mark.parametrize("case", ["equal", "mixed_padded", "cross_captions"])
def test_two_packs_per_batch_and_strided_inputs(case):
    """b = 2 (the same segments in both), and q/k/v as strided slices of one fused [s, b, np, 3*hn] tensor."""
    (query, key, value), params = inputs_for(case, batch=2)
    assert_same_forward_backward(
        lambda *t: sdpa_per_segment(*t, params, SCALE),
        lambda *t: sdpa_segment_loop(*t, params, SCALE),
        (query, key, value),
    )
    if case != "equal":
        return
    fused = rand(query.shape[0], 2, 2, 12, seed=3)

    def from_fused(qkv):
        return sdpa_per_segment(*qkv.split(4, dim=-1), params, SCALE)

    def reference(qkv):
        return sdpa_segment_loop(*qkv.split(4, dim=-1), params, SCALE)

    assert_same_forward_backward(from_fused, reference, (fused,))
    swapped = rand(2, query.shape[0], 2, 4, seed=4).transpose(0, 1)  # b and s swapped in memory: copied
    assert_same_forward_backward(
        lambda t: sdpa_per_segment(t, t, t, params, SCALE),
        lambda t: sdpa_segment_loop(t, t, t, params, SCALE),
        (swapped,),
    )


def count_kernel_calls(monkeypatch) -> list[int]:
    calls = []
    for name in ("_FLASH", "_FLASH_BACKWARD"):
        kernel = getattr(sdpa_cpu, name)
        monkeypatch.setattr(sdpa_cpu, name, lambda *a, _k=kernel, **kw: calls.append(1) or _k(*a, **kw))
    return calls


@pytest.mark.parametrize("case, calls", [("equal", 1), ("equal_padded", 1), ("mixed", 3), ("cross_captions", 1)])
def test_one_kernel_call_per_query_length(monkeypatch, case, calls):
    """Forward and backward each call the kernel once per distinct query length; equal lengths at
    a regular stride are views of the pack (no gathered copy)."""
    counted = count_kernel_calls(monkeypatch)
    (query, key, value), params = inputs_for(case)
    sdpa_per_segment(query, key, value, params, SCALE).sum().backward()
    assert len(counted) == 2 * calls
    plan = segment_plan(params, query.shape[0], key.shape[0], query.device)
    assert (plan.groups[0].q.strided is not None) == (case != "mixed")


def test_plan_built_once_per_pack_shape():
    (query, key, value), params = inputs_for("mixed")
    plan = segment_plan(params, query.shape[0], key.shape[0], query.device)
    assert segment_plan(params, query.shape[0], key.shape[0], query.device) is plan
    _, same_shape = inputs_for("mixed")  # another pack laid out alike (the next step's): the same plan
    assert segment_plan(same_shape, query.shape[0], key.shape[0], query.device) is plan
    (query, key, _), other = inputs_for("mixed_padded")
    params.host = other  # another pack's host bounds: a new plan, its own
    changed = segment_plan(params, query.shape[0], key.shape[0], query.device)
    assert changed is not plan
    assert [g.q.length for g in changed.groups] == [g.q.length for g in plan_segments(*mixed_padded_segments()).groups]


def test_packs_whose_captions_fit_the_longest_share_one_plan_masked_per_pack():
    """One-shape packs pad each caption to the pack's longest: the next pack, other caption lengths,
    reuses the plan's rows (no new plan) with its own key mask, and attends as per-segment SDPA does."""
    q_lens, kv_padded = [4] * 5, [5] * 5
    first = segments(q_lens, q_lens, [2, 5, 1, 3, 5], kv_padded, kind=PackedSegments)
    second = segments(q_lens, q_lens, [5, 4, 5, 1, 2], kv_padded, kind=PackedSegments)
    plans = [segment_plan(params, 20, 25, torch.device("cpu")) for params in (first, second)]
    assert plans[0].groups[0].kv is plans[1].groups[0].kv and plans[0].groups[0].kv.strided is not None
    masks = [plan.groups[0].mask[:, 0, 0].sum(-1).tolist() for plan in plans]
    assert masks == [[2, 5, 1, 3, 5], [5, 4, 5, 1, 2]]
    inputs = (rand(20, 1, 2, 4), rand(25, 1, 2, 4, seed=1), rand(25, 1, 2, 4, seed=2))
    assert_same_forward_backward(
        lambda *t: sdpa_per_segment(*t, second, SCALE), lambda *t: sdpa_segment_loop(*t, second, SCALE), inputs
    )


def mixed_padded_segments():
    q_lens, q_padded, kv_lens, kv_padded = CASES["mixed_padded"]
    starts = [sum(q_padded[:i]) for i in range(len(q_padded))]
    kv_starts = [sum(kv_padded[:i]) for i in range(len(kv_padded))]
    return list(zip(starts, q_lens, kv_starts, kv_lens)), sum(q_padded), sum(kv_padded), "cpu", kv_padded


def test_saves_inputs_output_and_log_sum_exp_only():
    """The lean property: q, k, v, the output (one buffer) and per-group log-sum-exp, no per-group outputs."""
    (query, key, value), params = inputs_for("mixed_padded")
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = sdpa_per_segment(query, key, value, params, SCALE)
    plan = plan_segments([(0, 4, 0, 4), (5, 2, 5, 2), (7, 4, 7, 4), (13, 3, 13, 3), (16, 1, 16, 1)], 20, 20, "cpu")
    lse = sum(2 * group.q.index.numel() for group in plan.groups)
    assert sum(t.numel() for t in saved) == 3 * query.numel() + out.numel() + lse


@pytest.mark.parametrize("case, strided", [("captions_to_longest", True), ("captions_short_last_room", False)])
def test_captions_padded_to_the_longest_are_read_in_place(case, strided):
    """Keys at one stride with room for the longest caption: a view, gradients copied (not summed);
    otherwise gathered, short captions' padded slots re-reading their last key."""
    (query, key, _), params = inputs_for(case)
    plan = segment_plan(params, query.shape[0], key.shape[0], query.device)
    (group,) = plan.groups
    assert (group.kv.strided is not None) == strided and plan.kv_once == strided
    assert group.mask is not None


@pytest.mark.parametrize(
    ("segment_list", "kv_total", "covered"),
    [
        ([(0, 4, 0, 4), (4, 4, 4, 4), (8, 2, 8, 2)], 10, True),  # keys back to back, every row read
        ([(0, 4, 0, 4), (4, 4, 4, 4), (8, 2, 8, 2)], 12, False),  # the pack's padding rows at the end
        ([(0, 3, 0, 3), (4, 3, 4, 3)], 7, False),  # a padding row between two samples' keys
        (SEGMENT_LISTS["shared_keys"], 10, False),  # keys read twice: their grads are summed into zeros
    ],
)
def test_key_grads_need_no_zeroed_buffer_only_when_every_key_row_is_read(segment_list, kv_total, covered):
    plan = plan_segments(segment_list, max(q0 + n for q0, n, _, _ in segment_list), kv_total, torch.device("cpu"))
    assert plan.kv_covers_all is covered


def test_the_cpu_flash_check_reads_megatrons_layout_and_follows_sdpas_choice():
    """``uses_cpu_flash`` takes [s, b, np, hn] tensors and answers as SDPA's own choice on their
    [b, np, s, hn] views: flash for a plain fp32 pack, not with flash switched off or head dims apart."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qkv = torch.randn(12, 1, 2, 3 * 8)
    q, k, v = qkv.split(8, dim=-1)
    assert sdpa_cpu.uses_cpu_flash(q, k, v, SCALE)
    chosen = torch._fused_sdp_choice(*(sdpa_cpu.heads_first(t) for t in (q, k, v)), scale=SCALE)
    assert SDPBackend(chosen) == SDPBackend.FLASH_ATTENTION
    with sdpa_kernel(SDPBackend.MATH):
        assert not sdpa_cpu.uses_cpu_flash(q, k, v, SCALE)
    assert not sdpa_cpu.uses_cpu_flash(q, k, torch.randn(12, 1, 2, 4), SCALE)
