"""Steps with a mask of their own run without cuDNN attention (it builds an execution graph per new
shape, and a lookahead step's shape is new nearly every time); steps of t alone, the prefill and
everything after the call keep the backends as they were, and a caller who left cuDNN as the only
backend keeps it. The flags are PyTorch's global ones, so this is visible on a CPU too, where
cuDNN's flag changes nothing."""

import pytest
import torch
from tiny_models import tiny_model, tiny_seq2seq
from torch.nn.attention import SDPBackend, sdpa_kernel

from lookahead import Lookahead
from lookahead.runner import leave_cudnn_out


def _record(model):
    """(kind of forward pass, cuDNN attention enabled during it) for every forward pass."""
    seen = []

    def hook(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if kwargs.get("decoder_input_ids") is not None:  # encoder-decoder: a step of several tokens
            kind = "wide" if kwargs["decoder_input_ids"].shape[1] > 1 else "t alone"
        elif mask is None or mask.dim() == 2:  # the model builds the mask: the prompt, or t alone
            kind = "t alone" if kwargs["input_ids"].shape[1] == 1 else "prefill"
        else:
            kind = "masked"
        seen.append((kind, torch.backends.cuda.cudnn_sdp_enabled()))

    return seen, model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "t5"])
def test_masked_steps_leave_cudnn_out_and_nothing_else_changes(arch):
    model = tiny_seq2seq(arch) if arch == "t5" else tiny_model(arch)
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 9]])
    plain = model.generate(prompt, max_new_tokens=24, do_sample=False)
    seen, handle = _record(model)
    try:
        out = model.generate(
            prompt, max_new_tokens=24, do_sample=False, custom_generate=Lookahead(3, 4, 3, adaptive=True)
        )
    finally:
        handle.remove()
    assert torch.equal(out, plain)
    if arch != "t5":  # from the first prefill on: before it, the model check probes the model once
        seen = seen[[kind for kind, _ in seen].index("prefill") :]
    wide = [on for kind, on in seen if kind in ("masked", "wide")]
    alone = [on for kind, on in seen if kind == "t alone"]
    assert wide and not any(wide), seen  # every step with a mask of its own ran without cuDNN
    assert all(alone), seen  # t alone: the model's own mask and backends, as plain decoding
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the call


def test_a_caller_who_chose_cudnn_alone_keeps_it():
    assert leave_cudnn_out()
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        assert not leave_cudnn_out()  # cuDNN is all the caller allowed: left as it is
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        assert leave_cudnn_out()  # the caller's other backend runs those steps
    with sdpa_kernel([SDPBackend.MATH]):
        assert not leave_cudnn_out()  # cuDNN already off

    model = tiny_model("llama")
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 9]])
    seen, handle = _record(model)
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]):
            model.generate(prompt, max_new_tokens=16, do_sample=False, custom_generate=Lookahead(3, 4, 3))
            assert torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
    finally:
        handle.remove()
    masked = [on for kind, on in seen if kind == "masked"]
    assert masked and not any(masked)  # the caller's other backend, math, ran those steps
