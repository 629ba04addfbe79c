"""Cost curves timed again (``lookahead calibrate``), and the warning when a curve is timed on a
busy machine: a curve is kept once timed, so a bad one must be replaceable and should be noticed."""

import logging

import pytest
from tiny_models import char_tokenizer, tiny_model

from lookahead import cli_calibrate, costs
from lookahead.calibration import measure_again
from lookahead.cli import main

SLOW = 1000.0  # seconds per pass: what a curve timed beside a heavy job might say, far beyond the truth


@pytest.fixture
def own_cache(monkeypatch, tmp_path):
    """An empty cost-curve store, on disk and in memory."""
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.setattr(costs, "_curves", {})
    return tmp_path


def store(key: str, counts) -> None:
    costs._write_disk(key, costs.CostCurve(tuple((k, SLOW * k) for k in counts)))


def test_measure_again_replaces_the_stored_curves_of_that_model_only(own_cache):
    model = tiny_model("llama")
    own = costs.curve_key(model)
    batch_key = f"{own}|batch-2|context-64"
    other = own.replace("llama", "qwen2")  # another model's curve stays as it was
    for key, counts in ((own, costs.GRID), (batch_key, (1, 2, 3, 4)), (other, (1, 2))):
        store(key, counts)

    results = measure_again(model)

    assert [(r.batch, r.context) for r in results] == [(1, 0), (2, 64)]
    assert all(r.before(1) == SLOW for r in results)
    assert all(seconds < SLOW for r in results for _, seconds in r.after.points)
    assert [k for k, _ in results[1].after.points] == [1, 2, 3, 4]  # to the token count it had
    stored = costs.stored_curves(model)
    assert stored == {own: results[0].after, batch_key: results[1].after}
    assert costs._read_disk()[other] == [[1, SLOW], [2, 2 * SLOW]]


def test_measure_again_times_the_lone_curve_where_none_was_stored(own_cache):
    model = tiny_model("llama")
    (result,) = measure_again(model)
    assert result.before is None and result.after.points[0][0] == 1
    assert costs.stored_curves(model) == {costs.curve_key(model): result.after}


@pytest.mark.parametrize("load,warned", [(10.0, True), (2.0, False)])
def test_a_curve_timed_on_a_busy_machine_is_warned_of(monkeypatch, caplog, load, warned):
    monkeypatch.setattr(costs.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(costs.os, "cpu_count", lambda: 2)
    with caplog.at_level(logging.WARNING, logger="lookahead.costs"):
        costs.measure(lambda k: None, counts=(1, 2), pairs=1)
    said = [r.getMessage() for r in caplog.records]
    assert any("load average 10.0 on 2 cores" in m and "lookahead calibrate" in m for m in said) == warned


def test_the_command_times_them_again_and_shows_before_and_now(own_cache, tmp_path, capsys):
    path = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    command = ["calibrate", "--model", str(path), "--dtype", "float32", "--device", "cpu"]

    def lone_rows() -> dict[str, list[str]]:  # "before" / "now" -> the row's cells after the label
        out = capsys.readouterr().out
        assert f"cost curves of {path} (float32, cpu), timed again in" in out
        rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| one sequence |")]
        return {cells[1].strip(): [c.strip() for c in cells[2:]] for cells in rows}

    assert main(command) == 0
    first = lone_rows()
    assert first["before"][0] == "(none stored)"
    assert float(first["now"][0]) > 0 and len(first["now"]) == 1 + len(cli_calibrate.SHOWN)
    assert main(command) == 0
    assert lone_rows()["before"] == first["now"]  # what the first run stored is what the second replaced
