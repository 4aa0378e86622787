import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/_tolerance.py: tolerances from dtype and magnitude

# one thread: the test tensors are small, and one thread is faster and steadier on a busy machine
torch.set_num_threads(1)
# flex runs eagerly in the default suite (compiling takes seconds per shape; slow tests compile)
os.environ.setdefault("ATTNLAB_FLEX_COMPILE", "0")
# no kernel probe and no cache of its choices: each choice is the forced or the default one, never a timing's
os.environ.setdefault("ATTNLAB_PROBE", "0")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def python_tiled(monkeypatch):
    """The tiled backend's PyTorch loop for requests the C++ kernel would serve
    (tests/test_native_flash.py tests that one)."""
    from attnlab.backends import tiled

    monkeypatch.setattr(tiled, "native_applies", lambda q: False)


@pytest.fixture(scope="session")
def shakespeare():
    """The real tiny-shakespeare text (``ATTNLAB_DATA_DIR``, else the user cache, else a download); the test
    is skipped, with the reason, when none has it (a fresh clone offline)."""
    from attnlab.data.datasets import DataUnavailableError, load_text
    try:
        return load_text("tinyshakespeare")
    except DataUnavailableError as e:  # offline and no local copy: nothing to train on
        pytest.skip(f"tiny-shakespeare unavailable: {e}")
