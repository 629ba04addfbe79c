"""`lookahead bench` end to end on a tiny saved checkpoint: tables, JSON and plots are written."""

import json

from tiny_models import char_tokenizer, tiny_model

from lookahead.cli import main


def test_bench_writes_json_markdown_and_plot(tmp_path, capsys):
    checkpoint = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(checkpoint)
    char_tokenizer().save_pretrained(checkpoint)
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "abcabcabcabcab"}\n\n{"prompt": "xyzxyzxyz", "id": "second"}\n')
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
    report = json.loads((out / "mine.json").read_text())
    methods = [row["method"] for row in report["summary"]]
    assert methods == ["greedy", "prompt_lookup(3)", "lookahead(auto)", "lookahead(2,3,2)"]
    for row in report["summary"]:
        assert row["identical"] == 1.0  # fp32: every method reproduces greedy
        assert row["tokens_per_second"] > 0 and row["speedup"] > 0
    assert {r["prompt"] for r in report["runs"]} == {"mine/0", "second"}
    assert report["meta"]["load_average"] >= 0
    assert (out / "mine.png").stat().st_size > 10_000
    table = (out / "mine.md").read_text()
    assert "| lookahead(2,3,2) |" in table and "speedup vs greedy" in table
    assert "| greedy |" in capsys.readouterr().out


def test_bench_rejects_unknown_dataset(capsys):
    assert main(["bench", "nope", "--model", "smollm2"]) == 1
    assert "unknown dataset 'nope'" in capsys.readouterr().err
