"""The step layout: hand-checked tables, and the laws every layout must obey."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lookahead.layout import build_layout, chain_shape, node_tokens, tree_shape


def visible(layout, row):
    return set(torch.nonzero(layout.mask[row]).flatten().tolist())


def test_positions_match_the_paper_example():
    # W=5, N=4 (3 levels), G=2: t + level 0 | level 1 | level 2 | candidate 0 | candidate 1
    layout = build_layout(1, 5, 3, 2, 3)
    assert layout.positions.tolist() == [0, 1, 2, 3, 4] + [1, 2, 3, 4, 5] + [2, 3, 4, 5, 6] + [1, 2, 3] * 2
    assert layout.length == 21
    assert layout.t_slot == 0
    assert layout.level_slots == ((1, 2, 3, 4), (5, 6, 7, 8, 9), (10, 11, 12, 13, 14))
    assert layout.candidate_slots == ((15, 16, 17), (18, 19, 20))
    assert layout.last_level_slots == (10, 11, 12, 13, 14)


def test_mask_rows_hand_checked():
    layout = build_layout(1, 5, 3, 2, 3)
    assert visible(layout, 0) == {0}  # t
    assert visible(layout, 3) == {0, 1, 2, 3}  # level 0, column 3
    assert visible(layout, 5) == {0, 5}  # level 1, column 0: t then itself
    assert visible(layout, 7) == {0, 1, 2, 7}  # level 1, column 2
    assert visible(layout, 12) == {0, 1, 2, 7, 12}  # level 2, column 2
    assert visible(layout, 17) == {0, 15, 16, 17}  # candidate 0, token 2
    assert visible(layout, 18) == {0, 18}  # candidate 1, token 0


def test_logits_only_for_used_rows():
    layout = build_layout(1, 5, 3, 2, 3)
    assert layout.logit_slots.tolist() == [0, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    assert layout.logit_index[10] == 1
    assert layout.candidate_position[19] == (1, 1)
    # while the window holds level 0 only, t's row is column 0 of the last level
    warm = build_layout(1, 4, 1, 0, 0)
    assert warm.last_level_slots == (0, 1, 2, 3)


def test_edge_settings():
    plain = build_layout(1, 0, 0, 0, 0)  # W=0, G=0: plain decoding
    assert plain.length == 1 and plain.last_level_slots == () and plain.candidate_slots == ()
    narrow = build_layout(1, 1, 3, 1, 3)  # W=1: one column, level 0 is empty
    assert narrow.positions.tolist() == [0, 1, 2, 1, 2, 3]
    assert narrow.last_level_slots == (2,)
    assert visible(narrow, 2) == {0, 1, 2}
    prefix = build_layout(3, 2, 2, 1, 1)  # three uncached tokens, t is the last
    assert prefix.positions.tolist() == [-2, -1, 0, 1, 1, 2, 1]
    assert prefix.t_slot == 2


@given(
    n_prefix=st.integers(1, 3),
    window=st.integers(0, 6),
    n_levels=st.integers(0, 5),
    n_candidates=st.integers(0, 4),
    candidate_len=st.integers(0, 5),
)
def test_every_row_sees_exactly_one_token_per_earlier_position(n_prefix, window, n_levels, n_candidates, candidate_len):
    """The law behind exactness: each row's context is a plain sequence ending at its position."""
    layout = build_layout(n_prefix, window, n_levels, n_candidates, candidate_len)
    pos = layout.positions.tolist()
    assert layout.mask.shape == (layout.length, layout.length)
    for row in range(layout.length):
        seen = sorted(visible(layout, row))
        assert row in seen and max(seen) == row  # itself, and nothing later in the input
        assert sorted(pos[r] for r in seen) == list(range(-(n_prefix - 1), pos[row] + 1))


@given(
    window=st.integers(1, 6),
    n_levels=st.integers(1, 5),
    n_candidates=st.integers(1, 4),
    candidate_len=st.integers(1, 5),
)
def test_branches_and_candidates_never_see_each_other(window, n_levels, n_candidates, candidate_len):
    layout = build_layout(1, window, n_levels, n_candidates, candidate_len)
    window_rows = {r for level in layout.level_slots for r in level}
    for k, cand in enumerate(layout.candidate_slots):
        others = {r for j, c in enumerate(layout.candidate_slots) if j != k for r in c}
        for row in cand:
            assert not visible(layout, row) & (window_rows | others)
    cand_rows = {r for c in layout.candidate_slots for r in c}
    for row in window_rows:
        assert not visible(layout, row) & cand_rows


def test_token_tree_hand_checked():
    candidates = [(5, 9, 2), (5, 6, 1), (7, 3, 3)]
    shape = tree_shape(candidates)
    assert shape == ((0, 1, 2), (0, 3, 4), (5, 6, 7))
    assert node_tokens(candidates, shape) == [5, 9, 2, 6, 1, 7, 3, 3]
    layout = build_layout(1, 0, 0, shape=shape)
    assert layout.length == 9  # t + 8 nodes: the shared 5 costs one row, not two
    assert layout.positions.tolist() == [0, 1, 2, 3, 2, 3, 1, 2, 3]
    assert layout.candidate_slots == ((1, 2, 3), (1, 4, 5), (6, 7, 8))
    assert visible(layout, 5) == {0, 1, 4, 5}  # 1 after 6 after the shared 5: not 9 or 2
    assert visible(layout, 2) == {0, 1, 2}
    assert layout.candidate_position[1] == (0, 0) and layout.candidate_position[4] == (1, 1)
    assert layout.logit_slots.tolist() == list(range(9))


def test_chain_shape_is_the_untreed_layout():
    chained = build_layout(1, 4, 3, 3, 2)
    assert build_layout(1, 4, 3, shape=chain_shape(3, 2)).mask.equal(chained.mask)
    # distinct first tokens: the tree is the chains
    assert tree_shape([(1, 2), (3, 4), (5, 6)]) == chain_shape(3, 2)


def test_bad_tree_shapes_are_refused():
    with pytest.raises(ValueError, match="two parents"):
        build_layout(1, 0, 0, shape=((0, 1), (2, 1)))
    with pytest.raises(ValueError, match="numbered"):
        build_layout(1, 0, 0, shape=((1, 0),))


@given(
    window=st.integers(0, 4),
    n_levels=st.integers(0, 3),
    candidates=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=4), max_size=6),
)
def test_every_tree_path_reads_as_its_candidate_alone(window, n_levels, candidates):
    """A node row sees t, its ancestors and itself: each candidate's rows form the same context
    as that candidate verified on rows of its own, and each distinct prefix costs one row."""
    shape = tree_shape(candidates)
    layout = build_layout(1, window, n_levels, shape=shape)
    tokens = node_tokens(candidates, shape)
    n_prefixes = len({tuple(c[: j + 1]) for c in candidates for j in range(len(c))})
    assert len(layout.node_slots) == n_prefixes == len(tokens)
    window_rows = {r for level in layout.level_slots for r in level}
    for candidate, rows in zip(candidates, layout.candidate_slots, strict=True):
        assert [tokens[layout.node_slots.index(r)] for r in rows] == candidate
        for j, row in enumerate(rows):
            assert visible(layout, row) == {layout.t_slot, *rows[: j + 1]}
            assert layout.positions[row] == j + 1
            assert not visible(layout, row) & window_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 6])
def test_mask_from_the_layouts_cached_floats_equals_the_mask_from_bools(dtype, sliding_window):
    """The runner hands ``ModelTraits.build`` the layout's additive float mask, made once per device
    (``StepLayout.on_device``); it must give the very mask that the bool layout gives, holes and
    pads included, for full and sliding-window layers."""
    from lookahead.support import ModelTraits

    layout = build_layout(1, 4, 3, 3, 3)
    types = ("full_attention",) if sliding_window is None else ("full_attention", "sliding_attention")
    spec = ModelTraits(layer_types=types, sliding_window=sliding_window, max_positions=None)
    key_pos = torch.tensor([[-1, -1, 0, 1, 2, -1, 3], [0, 1, 2, 3, 4, 5, 6]])  # pads and a hole
    positions = layout.positions[None] + torch.tensor([[4], [7]])
    step_positions, step_floats, slots = layout.on_device(torch.device("cpu"), dtype)
    assert torch.equal(step_positions, layout.positions) and torch.equal(slots, layout.logit_slots)
    assert step_floats.dtype == dtype and torch.equal(step_floats == 0, layout.mask)
    from_bools = spec.build(layout.mask, key_pos, positions, dtype)
    from_floats = spec.build(step_floats, key_pos, positions, dtype)
    for got, want in zip(*(m.values() if isinstance(m, dict) else [m] for m in (from_floats, from_bools)), strict=True):
        assert got.shape == want.shape == (2, 1, layout.length, key_pos.shape[1] + layout.length)
        assert torch.equal(got, want)
    full = from_floats["full_attention"] if isinstance(from_floats, dict) else from_floats
    assert torch.equal(full[:, 0, :, :7] == 0, (key_pos >= 0)[:, None, :].expand(2, layout.length, 7))
    assert layout.on_device(torch.device("cpu"), dtype)[1] is step_floats  # made once


def test_a_layout_first_built_under_inference_mode_serves_later_calls_with_autograd_on():
    """Layouts are cached across calls. A server's engine thread steps under
    ``torch.inference_mode``; a layout it builds first must still work in a later call that runs
    with autograd on (an inference tensor there raises "Inference tensors cannot be saved for
    backward")."""
    weight = torch.ones(3, requires_grad=True)
    with torch.inference_mode():
        layout = build_layout(2, 3, 2, 2, 5)  # arguments no other test uses: built here first
        derived = layout.on_device(torch.device("cpu"), torch.float32)
    for tensor in (layout.positions, layout.mask, layout.logit_slots, *derived):
        assert not tensor.is_inference()
    picked = weight[layout.logit_slots % 3]  # an index that autograd records
    picked.sum().backward()
    assert weight.grad is not None
