import os

import pytest
import torch

# one thread: the test tensors are small, and one thread is faster and steadier on a busy machine
torch.set_num_threads(1)
# flex runs eagerly in the default suite (compiling takes seconds per shape; slow tests compile)
os.environ.setdefault("ATTNLAB_FLEX_COMPILE", "0")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
