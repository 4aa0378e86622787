import pytest
import torch

# one thread: the test tensors are small, and one thread is faster and steadier on a busy machine
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
