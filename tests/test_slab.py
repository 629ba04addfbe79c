"""The slab cache (every layer's keys and values in one tensor) against separate layer tensors.

A runner with a slab and one without are driven through the same prefill, steps, commits that
move entries, an admission, a drop and capacity growth; every step's logits must be the same.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import tiny_model
from transformers.cache_utils import DynamicLayer

from lookahead import slab as slab_module
from lookahead.layout import build_layout
from lookahead.runner import DecoderRunner
from lookahead.slab import Slab, SlabLayer
from lookahead.support import check_model


def _ids(gen: torch.Generator, count: int) -> list[int]:
    return torch.randint(3, 96, (count,), generator=gen).tolist()


def _drive(runner: DecoderRunner, seed: int = 0) -> list[torch.Tensor]:
    """Prefill, steps with commits that move entries, admissions, drops, beam reorders: every
    logits tensor."""
    gen = torch.Generator().manual_seed(seed)
    out = [runner.prefill([_ids(gen, 9), _ids(gen, 5)])]
    chains = build_layout(1, 0, 0, 2, 3)  # t, candidate 0 in slots 1-3, candidate 1 in slots 4-6
    window = build_layout(1, 3, 2, 2, 3)  # the same with a window of 3 columns and 2 levels
    # per step: the layout, and per sequence (accepted candidate, tokens kept)
    plan = [
        (chains, [(1, 3), (0, 2)]),  # sequence 0 keeps candidate 1's first two tokens: they move
        (window, [(None, 1), (1, 4)]),
        (chains, [(0, 4), (1, 2)]),
        ("admit", None),
        ("reorder", [2, 0, 0]),  # beam search's reorder: rows copied, one repeated, one dropped
        (window, [(1, 2), (None, 1), (0, 3)]),
        ("reorder", [0, 1, 2]),  # nothing moves
        ("select", [0, 2]),
        (chains, [(1, 4), (1, 1)]),
        ("admit", 40),  # longer than what the batch holds: every sequence gains holes on the left
        (window, [(0, 2), (1, 3), (1, 2)]),
        ("select", [1, 2]),  # the last sequence moves up a row
        ("admit", 3),  # a free row: admitted in place
        (chains, [(1, 2), (0, 4), (1, 3)]),
        ("select", [0, 2]),
        (window, [(1, 4), (0, 1)]),
        ("select", [1]),  # the short newcomer alone: the columns before its prompt are cut
        ("admit", 12),  # longer than it holds: holes on its left, in the columns cut before
        (chains, [(0, 3), (1, 4)]),
    ]
    for layout, picks in plan:
        if layout == "admit":
            out.append(runner.admit([_ids(gen, picks or 13)]))
            continue
        if layout in ("select", "reorder"):
            getattr(runner, layout)(picks)
            continue
        batch = runner.key_pos.shape[0]
        out.append(runner.step(layout, [_ids(gen, layout.length) for _ in range(batch)]))
        runner.commit(layout, picks)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_slab_steps_give_the_logits_of_separate_layer_tensors(arch, monkeypatch):
    monkeypatch.setattr(slab_module, "HEADROOM", 2)  # the slab grows several times on the way
    model = tiny_model(arch)
    spec = check_model(model)
    with_slab, without = DecoderRunner(model, spec), DecoderRunner(model, spec, slab=False)
    got, expected = _drive(with_slab), _drive(without)
    assert with_slab.slab is not None and without.slab is None
    assert all(isinstance(layer, SlabLayer) for layer in with_slab.cache.layers)
    assert len(got) == len(expected)
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"logits differ at call {step}"
    assert torch.equal(with_slab.key_pos, without.key_pos)
    cache = with_slab.hand_back()
    assert all(type(layer) is DynamicLayer for layer in cache.layers)
    for mine, theirs in zip(cache.layers, without.cache.layers, strict=True):
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-5, atol=1e-5)
        assert mine.keys.is_contiguous()


def test_the_prefill_writes_into_the_slab_the_model_check_sized(monkeypatch):
    """The probe of check_model reads the cache's shape, so a batch's prefill writes its keys and
    values straight into a slab (the prompt's cache is not copied into one afterwards)."""
    model = tiny_model("llama")
    spec = check_model(model)
    text = model.config.get_text_config(decoder=True)
    heads, dim = text.num_key_value_heads, text.hidden_size // text.num_attention_heads
    assert spec.cache_shape == (text.num_hidden_layers, heads, dim, torch.float32)
    runner = DecoderRunner(model, spec)
    made, real_empty = [], slab_module.Slab.empty
    monkeypatch.setattr(slab_module.Slab, "empty", lambda *args: made.append(real_empty(*args)) or made[-1])
    runner.prefill([[1, 5, 6, 7], [2, 3]])
    assert made == [runner.slab] and runner.slab.capacity == 4 + slab_module.HEADROOM
    assert runner.slab.end == 4 and all(isinstance(layer, SlabLayer) for layer in runner.cache.layers)


def test_a_model_cast_after_its_check_is_checked_again_and_keeps_its_slab(monkeypatch):
    """check_model remembers its answer per dtype: after a cast to bfloat16 the slab is sized in
    bfloat16, so the prefill still writes straight into it."""
    model = copy.deepcopy(tiny_model("llama"))  # the shared model must stay in float32
    assert check_model(model).cache_shape[3] == torch.float32
    model.to(torch.bfloat16)
    spec = check_model(model)
    assert spec.cache_shape[3] == torch.bfloat16
    runner = DecoderRunner(model, spec)
    runner.prefill([[1, 5, 6, 7], [2, 3]])
    assert runner.slab is not None and all(isinstance(layer, SlabLayer) for layer in runner.cache.layers)


def test_sliding_layers_that_drop_columns_keep_tensors_of_their_own():
    model = tiny_model("gemma3_text")
    runner = DecoderRunner(model, check_model(model))
    runner.prefill([[1, 5, 6, 7]])
    assert runner.slab is None
    kept = DecoderRunner(model, check_model(model), bound_sliding=False)  # a cache handed back keeps all
    kept.prefill([[1, 5, 6, 7]])
    assert kept.slab is not None


def test_a_slab_layer_refuses_what_would_desynchronise_its_slab():
    model = tiny_model("llama")
    runner = DecoderRunner(model, check_model(model))
    runner.prefill([[1, 5, 6, 7]])
    with pytest.raises(NotImplementedError, match="Slab.select"):
        runner.cache.batch_select_indices(torch.tensor([0]))


def test_a_reorder_to_more_rows_grows_the_slab_with_copies():
    """Beam search's shared prefill: two prompts' entries copied into five rows, every layer."""
    slab = Slab.empty(2, 2, 1, 3, 4, torch.float32, "cpu")
    keys = torch.arange(24.0).view(2, 1, 4, 3)  # [B, H, C, D]
    for layer in slab.layers:
        layer.update(keys + 100 * layer.index, -keys)
    slab.reorder([0, 0, 1, 1, 1])
    assert slab.batch == 5 and slab.data.shape[1] == 5
    for layer in slab.layers:
        torch.testing.assert_close(layer.keys, (keys + 100 * layer.index)[[0, 0, 1, 1, 1]])
        torch.testing.assert_close(layer.values, -keys[[0, 0, 1, 1, 1]])
