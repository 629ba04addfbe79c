import pytest
import torch

torch.set_num_threads(2)


class ForwardCounter:
    """Counts a model's forward passes (prefill and steps alike)."""

    def __init__(self, model):
        self.count = 0
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += 1

    def close(self):
        self._handle.remove()


@pytest.fixture
def count_forwards():
    counters = []

    def make(model):
        counter = ForwardCounter(model)
        counters.append(counter)
        return counter

    yield make
    for counter in counters:
        counter.close()
