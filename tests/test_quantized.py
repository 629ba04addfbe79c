"""Quantized weights: lookahead's output is plain generate's on the same quantized model.

"Exact" for quantized weights means identical, token for token, to ``model.generate`` on the same
quantized model (not to the full-precision model, whose text the quantization changes). Every
scheme of ``lookahead.quantization.SCHEMES`` is loaded through ``lookahead.models.load`` as a user
loads it, with fp32 activations (bitsandbytes' 8-bit kernel casts them to fp16 itself), and checked
alone and in a left-padded batch, with multi-token steps asserted (the schemes that round
activations, ``quantization.ROUNDS_ACTIVATIONS``, are exact only up to near-ties, as bf16 is; the
tiny model's wide margins meet no such tie, so they are checked on it alone). Schemes whose layers let the
tokens of one forward pass change each other's output are refused, naming the scheme, and the
tests show why: unchecked, they change the text. Cost curves are keyed by the scheme, so the tuner
prices a quantized model's steps with its own measured curve.
"""

import copy
import functools
import importlib.util
import json

import pytest
import torch
from tiny_models import char_tokenizer, repetitive_prompt, tiny_model
from transformers import AutoModelForCausalLM

from lookahead import Lookahead, UnsupportedModelError, costs, models, quantization, support
from lookahead.cli import main

# scheme -> the package that quantizes with it (the quant extra, which ./scripts/setup.sh installs)
PACKAGES = {
    "int8": "torchao",
    "int4": "torchao",
    "int8-dynamic": "torchao",
    "quanto-int8": "optimum.quanto",
    "quanto-int4": "optimum.quanto",
    "bnb-8bit": "bitsandbytes",
    "bnb-4bit": "bitsandbytes",
}
NEW_TOKENS = 40


def needs_package(package: str) -> None:
    if importlib.util.find_spec(package.split(".")[0]) is None or importlib.util.find_spec(package) is None:
        pytest.skip(f"needs {package}: ./scripts/setup.sh installs it (the quant extra)")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny llama and its character tokenizer, saved as a checkpoint folder to load quantized."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


@functools.cache
def quantized(path, scheme: str):
    model, _ = models.load(str(path), quantization=scheme)
    return model


def left_padded(lengths, seed=0):
    """Repetitive prompts of the given lengths, left-padded with 0: (input_ids, attention_mask)."""
    rows = [repetitive_prompt(n, seed + i)[0] for i, n in enumerate(lengths)]
    ids = torch.zeros(len(rows), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, ids.shape[1] - len(row) :] = row
        mask[i, ids.shape[1] - len(row) :] = 1
    return ids, mask


def assert_exact(model, inputs: list[dict], setting=(4, 4, 4), new_tokens=NEW_TOKENS):
    """Each call's lookahead output equals plain greedy's, and some step emitted several tokens."""
    steps = emitted = 0
    for kwargs in inputs:
        expected = model.generate(**kwargs, max_new_tokens=new_tokens, do_sample=False)
        lookahead = Lookahead(*setting)
        got = model.generate(**kwargs, max_new_tokens=new_tokens, do_sample=False, custom_generate=lookahead)
        assert got.tolist() == expected.tolist()
        stats = lookahead.last_stats
        steps, emitted = steps + stats.sequence_steps, emitted + stats.new_tokens
    assert steps < emitted, "no multi-token step happened"


# torchao's int8 and int4 weight-only run in the quick suite; the rest take longer to load or run
SLOW = {"int8-dynamic", "quanto-int8", "quanto-int4", "bnb-8bit", "bnb-4bit"}


@pytest.mark.parametrize(
    "scheme", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW else s for s in quantization.SCHEMES]
)
def test_quantized_tiny_llama_matches_plain_generate(scheme, checkpoint):
    """Alone and in a left-padded batch, lookahead's tokens are plain generate's on the same
    quantized model, and some steps emit several tokens."""
    needs_package(PACKAGES[scheme])
    model = quantized(checkpoint, scheme)
    assert quantization.scheme(model) is not None and support.check_model(model).positions
    assert_exact(model, [dict(input_ids=repetitive_prompt(24, seed)) for seed in range(2)], new_tokens=32)
    ids, mask = left_padded((12, 24, 7), seed=3)
    assert_exact(model, [dict(input_ids=ids, attention_mask=mask)], setting=(2, 3, 2), new_tokens=24)


def per_tensor_int8_activations():
    import torchao.quantization as ao
    from transformers import TorchAoConfig

    return TorchAoConfig(ao.Int8DynamicActivationInt8WeightConfig(granularity=ao.PerTensor()))


def llm_int8_with_outliers():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_8bit=True)  # llm_int8_threshold=6.0


# the scheme, and an input on which lookahead, unchecked, gives another text than plain generate
MIXING = {
    "torchao-per-tensor": (
        "torchao",
        per_tensor_int8_activations,
        r"torchao Int8DynamicActivationInt8WeightConfig\(granularity=PerTensor",
        lambda: dict(input_ids=repetitive_prompt(24, 0)),
    ),
    "bnb-llm-int8": (
        "bitsandbytes",
        llm_int8_with_outliers,
        r"bitsandbytes 8-bit \(LLM.int8\(\), outlier threshold 6.0\)",
        lambda: dict(zip(("input_ids", "attention_mask"), left_padded((12, 20, 7), seed=2), strict=True)),
    ),
}


@pytest.mark.parametrize("case", list(MIXING))
def test_schemes_that_let_tokens_meet_are_refused_by_name(case, checkpoint, monkeypatch):
    """A per-tensor activation scale, or LLM.int8()'s outlier columns, are chosen over every token of
    a forward pass: a wider step changes the scale or the columns, and so the text. Refused, naming
    the scheme; with the check switched off, lookahead's text indeed differs from plain generate's."""
    package, settings, name, inputs = MIXING[case]
    needs_package(package)
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, quantization_config=settings(), device_map="cpu"
    ).eval()
    with pytest.raises(UnsupportedModelError, match=name) as refusal:
        model.generate(**inputs(), max_new_tokens=8, do_sample=False, custom_generate=Lookahead(4, 4, 4))
    assert "depend on the other tokens of the forward pass" in str(refusal.value)
    monkeypatch.setattr(support, "mixing_problem", lambda model: None)
    plain = model.generate(**inputs(), max_new_tokens=24, do_sample=False)
    unchecked = model.generate(**inputs(), max_new_tokens=24, do_sample=False, custom_generate=Lookahead(4, 4, 4))
    assert unchecked.tolist() != plain.tolist()


def test_the_cost_curve_is_measured_for_the_quantized_model(checkpoint, monkeypatch, tmp_path):
    """The curve a quantized model's steps are priced with is its own, measured and kept under a
    key that names the scheme, even for weights quantized after loading (the config unchanged)."""
    needs_package("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    from lookahead.calibration import model_cost_curve

    plain = tiny_model("llama")
    after = copy.deepcopy(plain)
    quantize_(after, Int8WeightOnlyConfig())
    loaded = quantized(checkpoint, "int8")
    keys = [costs.curve_key(model) for model in (plain, after, loaded)]
    assert len(set(keys)) == 3 and "weights" not in keys[0]
    assert keys[1].endswith("|weights Int8Tensor weights")
    assert keys[2].endswith("|weights torchao Int8WeightOnlyConfig(granularity=PerRow)")
    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.setattr(costs, "_curves", {})
    model_cost_curve(loaded)
    assert costs._read_disk().keys() == {keys[2]}


def test_an_unknown_scheme_is_refused_with_the_known_ones(checkpoint):
    with pytest.raises(ValueError, match="unknown quantization 'int3': use one of int8, int4"):
        models.load(str(checkpoint), quantization="int3")


def test_bench_runs_plain_and_lookahead_on_the_same_quantized_model(checkpoint, tmp_path, capsys):
    needs_package("torchao")
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "abcabcabcabcab"}\n')
    out = tmp_path / "results"
    args = ["bench", str(prompts), "--model", str(checkpoint), "--quantization", "int8", "--dtype", "float32"]
    assert main([*args, "--n", "1", "--max-new-tokens", "8", "--out", str(out), "--no-progress"]) == 0
    report = json.loads((out / "mine.json").read_text())
    assert report["meta"]["quantization"] == "int8" and report["meta"]["cost_curve"]
    rows = {row["method"]: row for row in report["summary"]}
    assert rows["greedy"]["identical"] == rows["lookahead(auto)"]["identical"] == 1.0
    assert "float32, int8 weights, 1 prompts" in capsys.readouterr().out


BUNDLED_PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
]


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_smollm2_matches_plain_generate(scheme):
    """The bundled SmolLM2, quantized as it loads: a prompt alone, and both in a left-padded batch
    (int8 weight-only runs slowly on CPU: a few minutes on 2 cores)."""
    needs_package(PACKAGES[scheme])
    model, tokenizer = models.load("smollm2", quantization=scheme)
    tokenizer.padding_side = "left"
    alone = dict(tokenizer(BUNDLED_PROMPTS[0], return_tensors="pt"))
    batch = dict(tokenizer(BUNDLED_PROMPTS, return_tensors="pt", padding=True))
    assert_exact(model, [alone, batch], setting=(2, 3, 2), new_tokens=24)
