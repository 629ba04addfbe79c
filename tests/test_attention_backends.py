"""Steps whose mask the runner builds itself run without cuDNN attention (it builds an execution
graph per new shape, and a lookahead step's shape is new nearly every time); steps the model masks
itself (t alone, the prefill) and everything after the call keep the backends as they were, also
when a step raises, and a caller who left cuDNN as the only backend keeps it. The flags are
PyTorch's global ones, so this is visible on a CPU too, where cuDNN's flag changes nothing."""

import pytest
import torch
from test_linear_models import tiny_bloom
from tiny_models import tiny_model, tiny_seq2seq
from torch.nn.attention import SDPBackend, sdpa_kernel

from lookahead import Lookahead
from lookahead.attention_switch import leave_cudnn_out

PROMPT = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 9] * 4])  # 48 tokens: longer than any step
FLAT = [(1, 1.0), (64, 1.0)]  # given, so that no calibration's passes (a cache without this curve) are seen


def _record(model):
    """(input tokens, whether the runner gave the mask, cuDNN attention enabled) per forward pass."""
    seen = []

    def hook(module, args, kwargs):
        ids = kwargs.get("decoder_input_ids")
        if ids is not None:  # encoder-decoder: the runner's steps are linear, the decoder's own mask
            seen.append((ids.shape[1], ids.shape[1] > 1, torch.backends.cuda.cudnn_sdp_enabled()))
            return
        length = kwargs["input_ids"].shape[1]
        seen.append((length, kwargs.get("attention_mask") is not None, torch.backends.cuda.cudnn_sdp_enabled()))

    return seen, model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bloom", "t5"])
def test_masked_steps_leave_cudnn_out_and_nothing_else_changes(arch):
    model = {"t5": lambda: tiny_seq2seq("t5"), "bloom": tiny_bloom}.get(arch, lambda: tiny_model(arch))()
    plain = model.generate(PROMPT, max_new_tokens=24, do_sample=False)
    seen, handle = _record(model)
    try:
        out = model.generate(
            PROMPT,
            max_new_tokens=24,
            do_sample=False,
            custom_generate=Lookahead(3, 4, 3, adaptive=True, cost_curve=FLAT),
        )
    finally:
        handle.remove()
    assert torch.equal(out, plain)
    if arch != "t5":  # from the prefill on (before it, the model check probes the model once)
        seen = seen[[length for length, _, _ in seen].index(PROMPT.shape[1]) :]
    masked = [on for _, runner_masked, on in seen if runner_masked]
    own = [on for _, runner_masked, on in seen if not runner_masked]
    assert masked and not any(masked), seen  # every step the runner masked ran without cuDNN
    assert own and all(own), seen  # the prefill and t alone: the model's own mask and backends
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the call


def test_the_flag_comes_back_when_a_step_raises():
    model = tiny_model("llama")
    passes = []

    def fail_on_the_third_masked_pass(module, args, kwargs):
        if kwargs.get("attention_mask") is not None and kwargs["attention_mask"].dim() == 4:
            passes.append(torch.backends.cuda.cudnn_sdp_enabled())
            if len(passes) == 3:
                raise RuntimeError("a step failed")

    handle = model.register_forward_pre_hook(fail_on_the_third_masked_pass, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="a step failed"):
            model.generate(PROMPT, max_new_tokens=24, do_sample=False, custom_generate=Lookahead(3, 4, 3))
    finally:
        handle.remove()
    assert passes[-1] is False  # it was off in the pass that raised
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_a_caller_who_chose_cudnn_alone_keeps_it():
    assert leave_cudnn_out()
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        assert not leave_cudnn_out()  # cuDNN is all the caller allowed: left as it is
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        assert leave_cudnn_out()  # the caller's other backend runs those steps
    with sdpa_kernel([SDPBackend.MATH]):
        assert not leave_cudnn_out()  # cuDNN already off

    model = tiny_model("llama")
    seen, handle = _record(model)
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]):
            model.generate(PROMPT, max_new_tokens=16, do_sample=False, custom_generate=Lookahead(3, 4, 3))
            assert torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
    finally:
        handle.remove()
    seen = seen[[length for length, _, _ in seen].index(PROMPT.shape[1]) :]
    masked = [on for _, runner_masked, on in seen if runner_masked]
    assert masked and not any(masked)  # the caller's other backend, math, ran those steps
