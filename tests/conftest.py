"""Fixtures shared by every test directory."""

import pytest


@pytest.fixture
def one_thread():
    """torch on one intra-op thread for the test: tiny matmuls on a shared 2-core machine run far faster with one
    (a second thread spin-waits; ~80x slower per Linear was measured here). A test module requests it for all its
    tests with an autouse fixture that takes it."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
