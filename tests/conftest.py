import os
import random

import numpy as np
import pytest
import torch

os.environ.setdefault("MIXPREC_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "mixprec"))


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same RNG state (torch, numpy, python)."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    yield
