"""What the command line's subcommands share: the device option, -W/-N/-G, quieting transformers."""

from __future__ import annotations

import logging


def device_for(name: str) -> str:
    """``auto``: the first CUDA device when there is one, else the CPU."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"unknown --device {name!r}: use cpu, cuda, cuda:N or auto") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this machine has no CUDA device (torch {torch.__version__}): use cpu")
    try:  # a device torch can name but not reach (mps without support, cuda:7 on one GPU)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as err:
        raise ValueError(f"--device {name} cannot be used here ({str(err).splitlines()[0]}): use cpu or auto") from err
    return name


def quiet_transformers() -> None:
    """No transformers warnings or progress bars among the command's own lines."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # transformers imports torchao wherever it is installed (the quant extra): its kernels for
    # GPUs this machine lacks, and torch's notes on its types, are no news to the command's user
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def wng(args) -> tuple[int | None, int | None, int | None]:
    """-W, -N and -G as given (None where not)."""
    return args.window_size, args.ngram_size, args.max_candidates
