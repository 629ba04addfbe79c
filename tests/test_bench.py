"""`lookahead bench` end to end on a tiny saved checkpoint: tables, JSON and plots are written."""

import dataclasses
import json
import math
import statistics
import time

import pytest
from tiny_models import char_tokenizer, tiny_model

from lookahead import bench, datasets, report
from lookahead.cli import main


def test_bench_writes_json_markdown_and_plot(tmp_path, capsys):
    checkpoint = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(checkpoint)
    char_tokenizer().save_pretrained(checkpoint)
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text(
        '{"prompt": "abcabcabcabcab", "kind": "abc"}\n\n{"prompt": "xyzxyzxyz", "id": "second", "kind": "xyz"}\n'
    )
    out = tmp_path / "results"
    code = main(
        [
            "bench",
            str(prompts),
            "--model",
            str(checkpoint),
            "--n",
            "2",
            "--max-new-tokens",
            "12",
            "--dtype",
            "float32",
            "-W",
            "2",
            "-N",
            "3",
            "-G",
            "2",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert f"written: {out}/mine.json, .md, .png" in printed  # where the user finds the files
    report = json.loads((out / "mine.json").read_text())
    methods = [row["method"] for row in report["summary"]]
    assert methods == ["greedy", "prompt_lookup(3)", "lookahead(auto)", "lookahead(2,3,2)"]
    for row in report["summary"]:
        assert row["identical"] == 1.0  # fp32: every method reproduces greedy
        assert row["tokens_per_second"] > 0 and row["speedup"] > 0
    assert {r["prompt"] for r in report["runs"]} == {"mine/0", "second"}
    assert report["meta"]["load_average"] >= 0
    curve = report["meta"]["cost_curve"]  # what the steps and the bounds were priced with
    assert curve[0][0] == 1 and all(a[1] <= b[1] for a, b in zip(curve, curve[1:], strict=False))
    assert (out / "mine.png").stat().st_size > 10_000
    table = (out / "mine.md").read_text()
    assert "| lookahead(2,3,2) |" in table and "speedup vs greedy" in table
    auto = next(row for row in report["summary"] if row["method"] == "lookahead(auto)")
    runs = [r for r in report["runs"] if r["method"] == "lookahead(auto)"]
    assert sum(auto["settings"].values()) == sum(sum(r["settings"].values()) for r in runs) > 0
    assert "Steps by setting, lookahead(auto):" in table
    ratio = curve[1][1] / curve[0][1]
    assert f"Cost curve (this machine's, as stored): T(k)/T(1) = {ratio:.2f}, " in table
    for row in report["summary"][1:]:  # each method's text against the clairvoyant bound on it
        # >= 1 up to rounding: where no candidate matches, the call's bound is greedy's own time, recomputed
        assert row["bound"] >= 1.0 - 1e-9 and row["share_of_bound"] == pytest.approx(row["speedup"] / row["bound"])
    assert report["summary"][0]["bound"] is None  # greedy is what the bound is relative to
    fixed = next(r for r in report["runs"] if r["method"] == "lookahead(2,3,2)")
    assert fixed["own_cap"] == 2 and fixed["bound_own_cap"] <= fixed["bound"]
    for run in report["runs"][1:]:  # the call's bound, prefill included, is below the decoding's
        if run["method"] != "greedy":
            assert 1.0 - 1e-9 <= run["bound"] <= run["bound_decode"] + 1e-9
    assert "Against the clairvoyant bound" in table and "| second | xyz | " in table
    assert [(k["method"], k["kind"], k["prompts"]) for k in report["kinds"]] == [
        (method, kind, 1) for method in methods[1:] for kind in ("abc", "xyz")
    ]
    assert "By prompt kind" in table and "| lookahead(auto) | xyz | 1 |" in table
    assert "| greedy |" in printed


def test_the_bound_is_the_calls_with_the_prefill_in_it():
    """Greedy: 101 tokens in 10 s, 1 s of it the prefill (so 0.09 s per token after the first). A
    clairvoyant decoding 3x as fast takes 1 + 100 x 0.09 / 3 = 4 s: 2.5x greedy's tokens per
    second, where the decoding's bound alone says 3x. A lookahead run of 51 tokens (bf16 texts
    part): 51 / (1 + 50 x 0.09 / 3) = 20.4 tokens/s against greedy's 10.1."""
    greedy = bench.Run("greedy", "p", 101, 10.0, True, 0.0)
    mine = bench.Run("lookahead(auto)", "p", 51, 5.0, False, 0.0, bound=3.0, bound_own_cap=2.0, prefill_seconds=1.0)
    other = bench.Run("prompt_lookup(3)", "p", 101, 6.0, True, 0.0, bound=3.0)  # no prefill of its own
    bench._call_bounds([greedy, mine, other])
    assert other.bound == pytest.approx(2.5) and other.bound_decode == 3.0  # lookahead's prefill serves all
    assert mine.bound == pytest.approx(51 / 2.5 / 10.1) and mine.bound_decode == 3.0
    assert mine.bound_own_cap == pytest.approx(51 / (1 + 50 * 0.09 / 2) / 10.1)
    alone = bench.Run("prompt_lookup(3)", "p", 101, 6.0, True, 0.0, bound=3.0)
    bench._call_bounds([bench.Run("greedy", "p", 101, 10.0, True, 0.0), alone])  # no prefill timed
    assert alone.bound == alone.bound_decode == 3.0


def test_the_share_of_the_bound_three_ways():
    """Prompt a: 2x of a 4x bound (50%), at its bound 100 / (4 x 10 tokens/s) = 2.5 s of its 5 s;
    prompt b: 5x of 5x (100%), 2 s of 2 s. Median prompt: 75%; pooled: 4.5 s of 7 s; median
    speedup over median bound: 3.5 / 4.5."""
    runs = [
        bench.Run("greedy", "a", 100, 10.0, True, 0.0),
        bench.Run("lookahead(auto)", "a", 100, 5.0, True, 0.0, bound=4.0),
        bench.Run("greedy", "b", 100, 10.0, True, 0.0),
        bench.Run("lookahead(auto)", "b", 100, 2.0, True, 0.0, bound=5.0),
    ]
    greedy, mine = report.summarize(runs)
    assert greedy["share_median_prompt"] is None and greedy["share_pooled"] is None
    assert mine["share_median_prompt"] == pytest.approx(0.75)
    assert mine["share_pooled"] == pytest.approx(4.5 / 7)
    assert mine["share_of_bound"] == pytest.approx(3.5 / 4.5)
    assert "| 75% | 64% |" in report.markdown([greedy, mine], "t")


def test_speedups_by_prompt_kind_with_an_interval_from_the_prompts_spread():
    """Greedy takes 10 s on every prompt. Kind "slow": log speedups -0.4, -0.3, -0.2, mean -0.3,
    standard deviation 0.1, so the 95% interval is exp(-0.3 +- 4.303 x 0.1 / sqrt 3) = 0.58-0.95x:
    below 1.0x beyond noise. Kind "mixed": 2x and 0.5x, geomean 1x, an interval far around 1. Kind
    "one": a single prompt, no interval."""
    speeds = {"s1": ("slow", -0.4), "s2": ("slow", -0.3), "s3": ("slow", -0.2), "m1": ("mixed", math.log(2)),
              "m2": ("mixed", math.log(0.5)), "o1": ("one", 0.0)}  # fmt: skip
    runs = []
    for prompt, (kind, log_speed) in speeds.items():
        runs.append(bench.Run("greedy", prompt, 100, 10.0, True, 0.0, kind=kind))
        runs.append(bench.Run("lookahead(auto)", prompt, 100, 10.0 / math.exp(log_speed), True, 0.0, kind=kind))
    slow, mixed, one = report.kind_rows(runs)
    assert (slow["kind"], slow["prompts"], slow["slowest_prompt"]) == ("slow", 3, "s1")
    assert slow["speedup"] == pytest.approx(math.exp(-0.3)) and slow["slowest"] == pytest.approx(math.exp(-0.4))
    half = 4.303 * 0.1 / math.sqrt(3)
    assert slow["interval"] == pytest.approx([math.exp(-0.3 - half), math.exp(-0.3 + half)])
    assert slow["below_one"] and slow["interval"][1] == pytest.approx(0.950, abs=1e-3)
    assert mixed["speedup_geomean"] == pytest.approx(1.0) and mixed["interval"][0] < 0.01 and not mixed["below_one"]
    assert one["interval"] is None and not one["below_one"]
    table = report.kind_markdown([slow, mixed, one])
    assert "| lookahead(auto) | slow | 3 | 0.74x | 0.74x | 0.58-0.95x | 0.67x (s1) |" in table
    assert "beyond noise (the whole interval under 1): lookahead(auto) on slow." in table
    assert report.kind_markdown([slow]) == ""  # one kind: the summary already says it
    bounded = [r if r.method == "greedy" else dataclasses.replace(r, bound=2.0) for r in runs]
    assert "| s1 | slow | 0.67x / 2.00x (34%) |" in report.prompt_markdown(bounded)
    same = [dataclasses.replace(r, kind="code") for r in bounded]
    assert "| s1 | 0.67x / 2.00x (34%) |" in report.prompt_markdown(same)  # one kind: no column for it


def test_the_plot_names_each_prompts_kind_where_there_are_several(tmp_path, monkeypatch):
    import matplotlib.figure

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    runs = []
    for prompt, kind in (("a", "math"), ("b", "coding")):
        runs.append(bench.Run("greedy", prompt, 10, 1.0, True, 0.0, kind=kind))
        runs.append(bench.Run("lookahead(auto)", prompt, 10, 0.5, True, 0.0, accepted_hist=[3, 2], kind=kind))
    report.plot(runs, report.summarize(runs), tmp_path / "p.png", "t")
    report.plot([dataclasses.replace(r, kind="code") for r in runs], report.summarize(runs), tmp_path / "q.png", "t")
    labels = [[t.get_text() for t in fig.axes[0].get_xticklabels()] for fig in saved]
    assert labels[0] == ["math", "coding"] and labels[1] == ["0", "1"]


def test_bench_rejects_unknown_dataset(capsys):
    assert main(["bench", "nope", "--model", "smollm2"]) == 1
    assert "unknown dataset 'nope'" in capsys.readouterr().err


def test_bench_by_batch_size(tmp_path, capsys):
    checkpoint = tmp_path / "tiny"
    tiny_model("gpt2").save_pretrained(checkpoint)
    char_tokenizer().save_pretrained(checkpoint)
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{"abcd"[i:] * (3 + i)}", "kind": "{i % 2}"}}\n' for i in range(4)))
    out = tmp_path / "results"
    args = ["bench", str(prompts), "--model", str(checkpoint), "--max-new-tokens", "10", "--dtype", "float32"]
    assert main([*args, "--batch-size", "1", "2", "--out", str(out), "--no-progress"]) == 0
    one = json.loads((out / "mine-batch1.json").read_text())
    two = json.loads((out / "mine-batch2.json").read_text())
    assert [r["method"] for r in one["summary"]] == ["greedy", "prompt_lookup(3)", "lookahead(auto)"]
    assert [r["method"] for r in two["summary"]] == ["greedy", "lookahead(auto)"]  # prompt lookup cannot batch
    assert len(two["runs"]) == 4 and all(r["identical"] for r in two["runs"])
    assert two["meta"]["batch_size"] == 2
    # what the batch's steps were priced with: a batch of 2 after 64 cached columns (GPT-2's 256
    # positions leave no room for the longer calibration), one sequence's curve for batch 1
    assert list(two["meta"]["batch_costs"]) == ["2"] and list(two["meta"]["batch_costs"]["2"]) == ["64"]
    assert two["meta"]["batch_costs"]["2"]["64"][0][0] == 1 and "cost_curve" in one["meta"]
    table = (out / "mine-batches.md").read_text()
    assert "| 2 | lookahead(auto) |" in table and "| 1 | prompt_lookup(3) |" in table
    assert one["summary"][2]["bound"] >= 1.0 - 1e-9 and two["summary"][1]["bound"] is None  # one sequence's bound only
    assert {k["kind"] for k in one["kinds"]} == {"0", "1"}
    assert two["kinds"] == [] and "By prompt kind" not in (out / "mine-batch2.md").read_text()  # batches mix kinds


def test_peak_memory_sees_memory_that_lived_inside_the_block():
    """The block maps 300 MB of fresh pages and touches each, so resident memory must rise by that
    much while it runs: a tensor would not do, since an allocator may hand back memory that earlier
    tests freed and the process still holds (seen in a full run: resident memory did not move)."""
    import mmap

    import psutil
    import torch

    from lookahead.bench import PeakMemory

    size, page = 300 * 2**20, mmap.PAGESIZE
    with PeakMemory(torch.device("cpu")) as memory:
        before = psutil.Process().memory_info().rss / 2**20
        block = mmap.mmap(-1, size)
        for offset in range(0, size, page):
            block[offset] = 1  # each page touched: resident
        time.sleep(0.05)
        block.close()
    assert memory.peak >= before + 250


def test_device_option_refuses_what_this_machine_lacks(capsys):
    import torch

    assert main(["bench", "humaneval", "--device", "gpu7"]) == 1
    assert "unknown --device 'gpu7'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["generate", "x", "--device", "cuda"]) == 1
        assert "no CUDA device" in capsys.readouterr().err


def test_bench_repeats_time_each_prompt_in_rotated_rounds(monkeypatch):
    """--repeats: each prompt's methods are timed R times, each round starting one method later,
    and a run's seconds are the median of its timings; outputs come from the first round."""
    model, tokenizer = tiny_model("llama"), char_tokenizer()
    prompts = [datasets.Prompt("p0", "abcabcabcabc", False), datasets.Prompt("p1", "xyzxyzxyzxyz", False)]
    methods = bench.methods_for(2, 3, 2)  # greedy, prompt lookup, Lookahead(), Lookahead(2, 3, 2)

    def label(kwargs: dict) -> str:  # which method a generate call is (greedy: none of the others)
        others = [m for m in methods[1:] if all(kwargs.get(k) is v for k, v in m.kwargs().items())]
        return others[0].name if others else methods[0].name

    calls = []
    real = type(model).generate

    def generate(self, *args, **kwargs):
        calls.append(label(kwargs))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "generate", generate)
    runs = bench.run_bench(model, tokenizer, prompts, methods, 8, progress=False, repeats=3)
    assert len(runs) == 2 * len(methods)
    for run in runs:
        assert len(run.repeat_seconds) == 3 and run.seconds == statistics.median(run.repeat_seconds)
        assert run.identical  # fp32 tiny model: every method reproduces greedy
    names = [m.name for m in methods]
    rounds = names + names[1:] + names[:1] + names[2:] + names[:2]  # each round starts one method later
    assert calls == names + rounds + rounds  # the warm-up, then both prompts
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        bench.run_bench(model, tokenizer, prompts, methods, 8, progress=False, repeats=0)


def test_adaptive_run_of_given_settings(capsys):
    """-W 0 --adaptive: the extra run is Lookahead() without the window (count drafting on), named
    from the device's defaults; --adaptive with no W/N/G is refused."""
    *_, fixed = bench.methods_for(3, 3, 2)
    assert fixed.name == "lookahead(3,3,2)" and not fixed.lookahead.config_for("cpu").adaptive
    *_, auto = bench.methods_for(0, adaptive=True, device="cuda")
    assert auto.name == "lookahead(auto, 0,5,15)"  # CUDA's N and G, not the CPU's
    cfg = auto.lookahead.config_for("cuda")
    assert cfg.adaptive and cfg.drafts and not auto.lookahead.config_for("cuda").window_size
    default = bench.methods_for(device="cuda")[-1].lookahead.config_for("cuda")
    assert default.drafts and default.window_size == 15  # CUDA's default drafts with its window
    model, tokenizer = tiny_model("llama"), char_tokenizer()
    *_, auto = bench.methods_for(0, adaptive=True)
    prompt = tokenizer("abcabcabcabcabc", return_tensors="pt")
    plain = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False, **auto.kwargs())
    assert out.tolist() == plain.tolist() and auto.lookahead._drafters  # it drafted, and exactly
    assert main(["bench", "humaneval", "--adaptive"]) == 1
    assert "--adaptive applies to the -W/-N/-G run" in capsys.readouterr().err


def test_time_budget_skips_the_prompts_it_leaves_no_time_for(tmp_path, capsys, caplog):
    """--time-budget: once the seconds have passed no further prompt starts; the first always
    runs, the report counts the prompts that ran, and a budget that is not positive is refused."""
    model, tokenizer = tiny_model("llama"), char_tokenizer()
    prompts = [datasets.Prompt(f"p{i}", "abc" * (4 + i), False) for i in range(3)]
    methods = bench.methods_for()
    runs = bench.run_bench(model, tokenizer, prompts, methods, 6, progress=False, time_budget=1e-9)
    assert {r.prompt for r in runs} == {"p0"} and len(runs) == len(methods)
    assert "ran out after 1 of 3 batches" in caplog.text
    runs = bench.run_bench(model, tokenizer, prompts, methods, 6, progress=False, time_budget=3600)
    assert [r.prompt for r in runs[:: len(methods)]] == ["p0", "p1", "p2"]

    checkpoint = tmp_path / "tiny"
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(f'{{"prompt": "{p.text}"}}\n' for p in prompts))
    args = ["bench", str(data), "--model", str(checkpoint), "--max-new-tokens", "6", "--dtype", "float32"]
    out = tmp_path / "results"
    assert main([*args, "--out", str(out), "--no-progress", "--time-budget", "1e-9"]) == 0
    report = json.loads((out / "mine.json").read_text())
    assert report["meta"]["n"] == 1 and {r["prompt"] for r in report["runs"]} == {"mine/0"}
    assert "time budget: 1 of 3 prompts ran" in capsys.readouterr().out
    assert main([*args, "--time-budget", "0"]) == 1
    assert "--time-budget must be a positive number of seconds" in capsys.readouterr().err


def test_cli_refuses_bad_options_in_one_line_before_loading_anything(tmp_path, capsys):
    """Each of these used to run (a model load, a calibration, a whole benchmark) before failing
    with a traceback, or not fail at all."""
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "abc"}\n')
    blocked = tmp_path / "file"
    blocked.write_text("")
    other = tmp_path / "other"
    other.mkdir()
    (other / "mine.jsonl").write_text('{"prompt": "abd"}\n')
    missing_model = str(tmp_path / "no-such-model")  # never reached: each check comes first
    cases = [
        (["bench", str(prompts), "--model", missing_model, "--out", str(blocked / "sub")], "--out"),
        (["bench", str(prompts), str(other / "mine.jsonl"), "--model", missing_model], "reports of the same name"),
        (["bench", str(prompts), "--model", missing_model, "--device", "mps"], "--device mps cannot be used here"),
        (["generate", "x", "--model", missing_model, "--temperature", "nan"], "--temperature must be a finite"),
        (["serve", "--model", missing_model, "--port", "99999"], "--port must be in 1-65535"),
        (["serve", "--model", missing_model, "--api-key", ""], "--api-key is empty"),
        (["serve", "--model", missing_model, "--plain", "-N", "3"], "--plain takes one-token steps"),
    ]
    for argv, message in cases:
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)


def test_encoder_decoder_checkpoints_count_their_decoder_tokens(tmp_path, capsys):
    """An encoder-decoder output is the decoder's, from its start token: generate --compare counts
    new tokens from there (it printed -2), and bench refuses such a model by name (it divided by 0)."""
    from tiny_models import tiny_seq2seq

    checkpoint = tmp_path / "t5"
    tiny_seq2seq("t5").save_pretrained(checkpoint)
    char_tokenizer().save_pretrained(checkpoint)
    argv = ["generate", "abcabcabc", "--model", str(checkpoint), "--max-new-tokens", "8", "--compare"]
    assert main(argv) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[plain generate]")][0]
    assert int(line.split()[2]) == 8 and "outputs identical" in line, line
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "abc"}\n')
    argv = ["bench", str(prompts), "--model", str(checkpoint), "--out", str(tmp_path / "out"), "--dtype", "float32"]
    assert main(argv) == 1
    assert "decoder-only models" in capsys.readouterr().err


def test_bench_num_beams_measures_against_plain_beam_search():
    """methods_for(num_beams=k): plain beam search is the baseline, and Lookahead()'s beam search
    is measured against it, identical, with its depths per pass as tokens/step."""
    model, tokenizer = tiny_model("llama"), char_tokenizer()
    prompts = [datasets.Prompt("p0", "abcabcabcabc", False)]
    methods = bench.methods_for(num_beams=3)
    assert [m.name for m in methods] == ["beam(3)", "lookahead beam(3)"]
    runs = bench.run_bench(model, tokenizer, prompts, methods, 8, progress=False)
    assert all(run.identical for run in runs)
    rows = report.summarize(runs)
    assert rows[0]["speedup"] == 1.0 and rows[0]["tokens_per_step"] == 1.0
    assert rows[1]["tokens_per_step"] >= 1.0
    assert "speedup vs beam(3)" in report.markdown(rows, "t")
