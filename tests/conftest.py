import os
import random

import numpy as np
import pytest
import torch

os.environ.setdefault("MIXPREC_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "mixprec"))


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same RNG state (torch, numpy, python) and leaves the environment as it found it
    (Lightning's seed_everything sets PL_GLOBAL_SEED, which a later test's DistributedSampler would then read)."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    environ = dict(os.environ)
    yield
    for key in set(os.environ) - set(environ):
        del os.environ[key]
    os.environ.update(environ)
