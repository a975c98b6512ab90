"""Fixtures shared by every test directory."""

import os
import sys

import pytest

# The suite sets what it needs itself (a user runs the README's command with none of it set): no Hub or datasets
# look-ups, no telemetry, no tokenizers thread pool. Set here, at conftest import, so that every process a test
# starts (recipes, `accelerate launch` and its ranks) inherits it too. A test of the online path overrides it
# locally (`unreachable_hub` in tests/integration/test_hub_errors.py).
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
               "TOKENIZERS_PARALLELISM": "false"}
os.environ.update(OFFLINE_ENV)


def set_offline_constants(offline: bool = True) -> None:
    """huggingface_hub and datasets read their offline flags at import: set those of the modules already imported
    (a plugin may have imported them before this conftest)."""
    if "huggingface_hub.constants" in sys.modules:
        sys.modules["huggingface_hub.constants"].HF_HUB_OFFLINE = offline
    if "datasets.config" in sys.modules:
        sys.modules["datasets.config"].HF_HUB_OFFLINE = sys.modules["datasets.config"].HF_DATASETS_OFFLINE = offline


set_offline_constants()


@pytest.fixture(autouse=True, scope="session")
def offline_hub():
    """The offline environment above, for the whole session (and back to it if a test left it changed)."""
    os.environ.update(OFFLINE_ENV)
    set_offline_constants()
    yield


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


@pytest.fixture(autouse=True)
def unfrozen_heap():
    """A test that ran a recipe entry point in-process (`run_recipe` freezes the heap: `freeze_startup_heap`) gives
    the frozen objects back to the collector, so later tests' garbage among them is still reclaimed."""
    yield
    import gc

    if gc.get_freeze_count():
        gc.unfreeze()


@pytest.fixture(scope="module")
def tokenizer():
    """The toy world's character tokenizer (trained locally, no download)."""
    from hf_rlhf.toy import build_toy_tokenizer

    return build_toy_tokenizer()


@pytest.fixture(scope="module")
def tiny_model(tokenizer):
    """A tiny toy causal LM (seed 0), shared by a module's tests: tests must not train it."""
    from hf_rlhf.toy import build_toy_model

    return build_toy_model(tokenizer, "tiny", seed=0)


@pytest.fixture
def tiny_model_dir(tmp_path, tokenizer):
    """A directory holding a tiny toy causal LM (seed 5) and its tokenizer, as the SFT recipe would leave it."""
    from hf_rlhf.toy import build_toy_model

    path = tmp_path / "sft"
    build_toy_model(tokenizer, "tiny", seed=5).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
