"""Fixtures shared by the integration tests (the toy tokenizer and tiny models come from tests/conftest.py)."""

import pytest


@pytest.fixture(scope="module")
def prompts():
    from hf_rlhf.toy import prompt_dataset

    return prompt_dataset(16, seed=0)
