"""Vision-language models: ``model.generate(**processor(images=..., text=...), custom_generate=
Lookahead())`` gives plain generate's tokens (fp32, greedy) for every family transformers builds
from a config here, with one image, two, none, and in padded batches mixing them; steps draft.
Beam search and sampling on a VLM, the position shift (Qwen2-VL's M-RoPE, PaliGemma's 1-based
positions) shown to matter, and the inputs still refused by name."""

import pytest
import torch
from test_sampling import ALPHA, chi2_pvalue
from tiny_models import tiny_model
from tiny_vlms import VLM_FAMILIES, image, tiny_vlm, vlm_inputs

import lookahead.runner
from lookahead import Lookahead

NEW = 40
GREEDY = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
# rows of (images, words): PaliGemma's processor takes no row without an image
CASES = {
    "one image": [(1, "abcabcabc")],
    "two images": [(2, "xyzxyz")],
    "text only": [(0, "hello hello")],
    "padded batch": [(1, "abab"), (0, "cdcdcdcd efef"), (2, "q")],
}
PALIGEMMA_CASES = {**CASES, "text only": None, "padded batch": [(1, "abab"), (2, "cdcdcdcd efef"), (1, "q")]}
SETTINGS = {"(4,4,4)": lambda: Lookahead(4, 4, 4, adaptive=False), "default": Lookahead}


def rows_for(family: str, case: str):
    rows = (PALIGEMMA_CASES if family == "paligemma" else CASES)[case]
    if rows is None:
        pytest.skip("PaliGemma's processor takes no text-only row")
    return rows


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_greedy_is_plain_generate_s(family, case, setting):
    model, _ = tiny_vlm(family)
    inputs = vlm_inputs(family, rows_for(family, case))
    plain = model.generate(**inputs, **GREEDY)
    lookahead = SETTINGS[setting]()
    ours = model.generate(**inputs, custom_generate=lookahead, **GREEDY)
    assert torch.equal(ours, plain)
    stats = lookahead.last_stats
    assert stats.new_tokens == NEW * inputs["input_ids"].shape[0]
    if setting == "(4,4,4)":  # fixed settings always draft: steps were multi-token
        assert stats.new_tokens > stats.sequence_steps


def test_paligemma_text_only_from_its_tokenizer():
    """PaliGemma's processor takes no text-only prompt, but its model does (1-based positions)."""
    model, processor = tiny_vlm("paligemma")
    inputs = processor.tokenizer(["hello hello hello"], return_tensors="pt")
    lookahead = Lookahead(4, 4, 4, adaptive=False)
    assert torch.equal(
        model.generate(**inputs, custom_generate=lookahead, **GREEDY), model.generate(**inputs, **GREEDY)
    )
    assert lookahead.last_stats.new_tokens > lookahead.last_stats.steps


@pytest.mark.parametrize("family", ["qwen2_vl", "paligemma"])
def test_the_position_shift_is_what_keeps_it_exact(family, monkeypatch):
    """Qwen2-VL continues after an image at its M-RoPE delta, PaliGemma counts from 1: steps that
    dropped the shift the prefill reports would change the text."""
    model, _ = tiny_vlm(family)
    inputs = vlm_inputs(family, [(2, "xyzxyz")])
    plain = model.generate(**inputs, **GREEDY)
    monkeypatch.setattr(lookahead.runner, "shifted", lambda positions, shift, stacked: positions)
    broken = model.generate(**inputs, custom_generate=Lookahead(4, 4, 4, adaptive=False), **GREEDY)
    assert not torch.equal(broken, plain)


def test_scores_are_plain_generate_s():
    model, _ = tiny_vlm("qwen2_vl")
    inputs = vlm_inputs("qwen2_vl", [(1, "abcabcabc")])
    kwargs = dict(GREEDY, return_dict_in_generate=True, output_scores=True)
    plain = model.generate(**inputs, **kwargs)
    ours = model.generate(**inputs, custom_generate=Lookahead(4, 4, 4, adaptive=False), **kwargs)
    assert torch.equal(ours.sequences, plain.sequences)
    assert len(ours.scores) == len(plain.scores) == NEW
    for mine, theirs in zip(ours.scores, plain.scores, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "gemma3"])
def test_beam_search_is_plain_beam_search(family):
    model, _ = tiny_vlm(family)
    inputs = vlm_inputs(family, [(1, "abab"), (2, "cdcdcdcd")] if family != "gemma3" else [(1, "abab")])
    kwargs = dict(max_new_tokens=24, num_beams=3, num_return_sequences=2, do_sample=False)
    kwargs.update(return_dict_in_generate=True, output_scores=True)
    plain = model.generate(**inputs, **kwargs)
    ours = model.generate(**inputs, custom_generate=Lookahead(4, 4, 4, adaptive=False), **kwargs)
    assert torch.equal(ours.sequences, plain.sequences)
    assert torch.equal(ours.beam_indices, plain.beam_indices)
    torch.testing.assert_close(ours.sequences_scores, plain.sequences_scores, rtol=1e-5, atol=1e-5)


SAMPLES, SAMPLED = 1200, 6


def test_sampling_keeps_the_distribution():
    """Draws after an image (Qwen2-VL, its positions shifted) match transformers' own sampling:
    a chi-square test per position and on the first pair, as for text models (test_sampling)."""
    model, _ = tiny_vlm("qwen2_vl")
    inputs = vlm_inputs("qwen2_vl", [(1, "abcabcabc")])
    kwargs = dict(do_sample=True, max_new_tokens=SAMPLED, min_new_tokens=SAMPLED, temperature=0.2)
    batch = 100
    many = {k: v.repeat(batch, *[1] * (v.dim() - 1)) for k, v in inputs.items()}  # pixel_values: [patches, D]
    torch.manual_seed(5)
    lookahead, ours, steps = Lookahead(4, 4, 4, adaptive=False), [], 0
    for _ in range(SAMPLES // batch):
        ours.append(model.generate(**many, custom_generate=lookahead, **kwargs)[:, -SAMPLED:])
        steps += lookahead.last_stats.sequence_steps
    torch.manual_seed(6)
    theirs = torch.cat([model.generate(**many, **kwargs)[:, -SAMPLED:] for _ in range(SAMPLES // batch)])
    ours = torch.cat(ours)
    vocab = model.config.get_text_config().vocab_size
    results = {f"position {i}": chi2_pvalue(ours[:, i], theirs[:, i]) for i in range(SAMPLED)}
    results["first pair"] = chi2_pvalue(ours[:, 0] * vocab + ours[:, 1], theirs[:, 0] * vocab + theirs[:, 1])
    print({k: round(v, 4) for k, v in results.items()}, f"tokens/step {SAMPLES * SAMPLED / steps:.3f}")
    assert min(results.values()) > ALPHA, results
    assert len(ours[:, 0].unique()) > 2  # the test has something to compare: not one-hot
    assert SAMPLES * SAMPLED / steps > 1.05  # multi-token steps happened


def test_video_inputs_are_refused_by_name():
    model, processor = tiny_vlm("qwen2_vl")
    inputs = vlm_inputs("qwen2_vl", [(1, "abc")])
    video = {"pixel_values_videos": inputs["pixel_values"], "video_grid_thw": inputs["image_grid_thw"]}
    with pytest.raises(ValueError, match="video"):
        model.generate(**inputs, **video, custom_generate=Lookahead(), **GREEDY)


def test_audio_inputs_are_refused_by_name():
    """What an audio-language model's generate would hand over (generate itself refuses them for a
    model that takes no audio, so the call's check is asked directly)."""
    from transformers import GenerationConfig

    from lookahead.step import validate_call

    with pytest.raises(ValueError, match=r"audio inputs yet \(input_features\)"):
        validate_call(torch.tensor([[1, 5, 6]]), GenerationConfig(), False, {"input_features": torch.zeros(1, 4, 8)},
                      model=tiny_model("llama"))  # fmt: skip


def test_a_batch_of_images_of_other_sizes():
    """Qwen2-VL's image token count follows the image's size: rows of 16, 32 and 48 px images,
    padded to one batch, each keep their own position shift."""
    model, processor = tiny_vlm("qwen2_vl")
    processor.tokenizer.padding_side = "left"
    text = ["<|vision_start|><|image_pad|><|vision_end|>" + words for words in ("ab", "cdcd", "efefef")]
    pictures = [image(1, 16), image(2, 32), image(3, 48)]
    inputs = processor(images=pictures, text=text, return_tensors="pt", padding=True)
    plain = model.generate(**inputs, **GREEDY)
    assert torch.equal(model.generate(**inputs, custom_generate=Lookahead(4, 4, 4, adaptive=False), **GREEDY), plain)
