"""Which attention kernel a step with a mask of the runner's own runs on: PyTorch's cuDNN attention
is left out of such steps where another kernel can take them (see :func:`leave_cudnn_out`)."""

from __future__ import annotations

import contextlib

import torch


def leave_cudnn_out() -> bool:
    """Whether steps whose mask the runner builds itself (every step but t alone in a batch
    without holes) should run without PyTorch's cuDNN attention: yes where it is on and another
    backend is on too (where it is the only one, the caller chose it; a priority order set with
    ``sdpa_kernel(..., set_priority=True)`` is not read).

    PyTorch prefers cuDNN attention on Hopper and newer GPUs (with a recent cuDNN), and by default
    it builds an execution graph for each new shape of query, keys and mask, kept per shape
    (``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``, opt-in, avoids that for some layouts). A lookahead
    step's shape is new nearly every time (a tree of its own over a longer cache), so every step
    would pay for a graph; on the H200 of 2026-12-04 every step cost about three times what the
    same shape cost repeated (docs/gpus.md; the cause is inferred, not yet timed both ways).
    The memory-efficient kernel, next in line for a mask, builds nothing. A step of t alone keeps
    the model's own mask, and so the kernel plain decoding uses (and its rounding). The switch is
    PyTorch's process-wide flag, off only while such a step's forward pass runs (back on if it
    raises): threads that run attention at the same time see it too, and one decoding call ending
    its step turns it back on for another's. The server runs every forward pass on its one engine
    thread."""
    cuda = torch.backends.cuda
    return cuda.cudnn_sdp_enabled() and (
        cuda.flash_sdp_enabled() or cuda.mem_efficient_sdp_enabled() or cuda.math_sdp_enabled()
    )


class _CudnnAttentionOff:
    """PyTorch's cuDNN attention off for the block, on again after (cheaper than ``sdpa_kernel``,
    which reads and sets every backend's flag)."""

    def __enter__(self) -> None:
        torch.backends.cuda.enable_cudnn_sdp(False)

    def __exit__(self, *exc) -> None:
        torch.backends.cuda.enable_cudnn_sdp(True)


AS_THEY_ARE = contextlib.nullcontext()  # a step with the model's own mask
CUDNN_OFF = _CudnnAttentionOff()  # a step with a mask of the runner's
