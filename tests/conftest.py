from __future__ import annotations

import pytest


@pytest.fixture
def restore_threads():
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
