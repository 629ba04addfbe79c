"""The step gate: wide steps only while they give more tokens per second than one-token steps."""

import pytest
from tiny_models import repetitive_prompt, tiny_model

from lookahead import Lookahead
from lookahead.gate import StepGate


def simulate(gate, wide_cost, wide_tokens, plain_cost=1.0, steps=64):
    kinds = []
    for _ in range(steps):
        wide = gate.wide()
        gate.record(wide, wide_cost if wide else plain_cost, wide_tokens if wide else 1)
        kinds.append(wide)
    return kinds


def test_measures_both_kinds_first():
    assert simulate(StepGate(), 1.5, 3, steps=2) == [True, False]


def test_keeps_wide_steps_that_pay_and_refreshes_the_plain_cost():
    kinds = simulate(StepGate(), wide_cost=1.5, wide_tokens=3)  # 2 tokens/s against 1
    assert sum(kinds) >= 52 and not all(kinds[2:])  # mostly wide, with plain probes
    assert all(any(kinds[i : i + 9]) for i in range(2, 56))


def test_falls_back_to_plain_steps_that_pay_better():
    kinds = simulate(StepGate(), wide_cost=2.0, wide_tokens=1.2, steps=200)  # 0.6 tokens/s against 1
    probes = [i for i, wide in enumerate(kinds) if wide]
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] >= 60  # probes back off: 8, 16, 32, 64 steps apart
    assert len(probes) <= 7 and probes[-1] > 120  # still probing, in case the text changes


def test_switches_when_the_text_starts_to_pay():
    gate = StepGate()
    simulate(gate, wide_cost=2.0, wide_tokens=1.0, steps=30)
    assert sum(simulate(gate, wide_cost=1.3, wide_tokens=3.5, steps=60)[-20:]) >= 17


def test_disabled_gate_is_always_wide():
    assert all(simulate(StepGate(enabled=False), wide_cost=5.0, wide_tokens=1.0))


def test_auto_adapts_and_explicit_settings_do_not():
    assert Lookahead().config_for("cpu").adaptive
    assert not Lookahead(4, 4, 4).config_for("cpu").adaptive
    assert Lookahead(4, 4, 4, adaptive=True).config_for("cpu").adaptive


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_adaptive_output_is_unchanged(arch):
    model = tiny_model(arch)
    for seed in range(3):
        prompt = repetitive_prompt(24, seed)
        expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
        la = Lookahead(3, 4, 3, adaptive=True)
        assert (
            model.generate(prompt, max_new_tokens=40, do_sample=False, custom_generate=la).tolist() == expected.tolist()
        )
        assert 0 < la.last_stats.wide_steps <= la.last_stats.steps
