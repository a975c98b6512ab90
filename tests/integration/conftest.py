"""Fixtures shared by the integration tests (the toy tokenizer and tiny models come from tests/conftest.py)."""

import pytest


@pytest.fixture(scope="module")
def prompts():
    from hf_rlhf.toy import prompt_dataset

    return prompt_dataset(16, seed=0)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tokenizer):
    """A saved small toy causal LM (seed 0) and its tokenizer: the "SFT checkpoint" a test's roles start from."""
    from hf_rlhf.toy import build_toy_model

    path = str(tmp_path_factory.mktemp("base"))
    build_toy_model(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
