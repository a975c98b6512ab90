"""Fixtures shared by the integration tests: the toy tokenizer and a few toy prompts."""

import pytest


@pytest.fixture(scope="module")
def tokenizer():
    from hf_rlhf.toy import build_toy_tokenizer

    return build_toy_tokenizer()


@pytest.fixture(scope="module")
def prompts():
    from hf_rlhf.toy import prompt_dataset

    return prompt_dataset(16, seed=0)
