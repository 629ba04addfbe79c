import os

import pytest
import torch
from tiny_models import SHARED

torch.set_num_threads(2)


def pytest_configure(config):
    """The suite keeps its own cache, a folder of the user's: a cost curve timed while the tests load
    the machine would otherwise price every later run of that model. It persists between runs, so
    the suite times each curve once; the bundled models already converted in the user's cache are
    linked into it, not converted again. Subprocesses (the server tests) inherit it through the
    environment."""
    from lookahead.models import BUNDLED, cache_dir

    user_cache = cache_dir()
    test_cache = user_cache / "test-suite"
    test_cache.mkdir(parents=True, exist_ok=True)
    for name in BUNDLED:
        link = test_cache / name
        if not link.exists() and not link.is_symlink() and (user_cache / name / "config.json").exists():
            link.symlink_to(user_cache / name, target_is_directory=True)
    os.environ["LOOKAHEAD_CACHE"] = str(test_cache)


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


@pytest.fixture(autouse=True)
def shared_models_stay_as_built():
    """tiny_model's models are shared by every test: one that casts or trains a shared model would
    silently change what later tests compare (a bfloat16 llama left behind once broke two exactness
    tests in other files). A test that needs to change a model changes a copy."""
    yield
    for model in SHARED:
        dtypes = {param.dtype for param in model.parameters()}
        assert dtypes == {torch.float32} and not model.training, (
            f"a test left the shared tiny {model.config.model_type} model changed "
            f"(dtypes {dtypes}, training={model.training}): change a copy.deepcopy of it instead"
        )
