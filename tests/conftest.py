import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny import fitted_heads, tiny_model  # noqa: E402

# tiny models gain nothing from a second thread; the demo-model tests set their own
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_cache():
    """Fitting heads takes a few seconds: share one (model, heads) pair per key."""
    store = {}

    def get(arch="llama", family="hydra", head_arch="mlp", seed=0):
        key = (arch, family, head_arch, seed)
        if key not in store:
            model = tiny_model(arch, seed=seed)
            store[key] = (model, fitted_heads(model, family, head_arch, seed=seed))
        return store[key]

    return get


def pytest_collection_modifyitems(config, items):
    # the real demo model's tests (and the wheel's, which loads it) are the slowest: run them last
    items.sort(key=lambda item: "demo" in item.nodeid or "wheel" in item.nodeid)
