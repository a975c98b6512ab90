"""The PPO recipe's `--tools`: importable functions by name, "none" switches a config's tools off."""

import os

import pytest

from hf_rlhf.cli.data_loading import load_tools
from hf_rlhf.cli.errors import RecipeOptionError
from hf_rlhf.toy.tool_task import add, multiply

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "recipes",
                      "configs", "tools_toy.yaml")


def test_tools_are_resolved_by_name():
    assert load_tools(["hf_rlhf.toy.tool_task:multiply"]) == [multiply]
    assert load_tools(["hf_rlhf.toy.tool_task:multiply,hf_rlhf.toy.tool_task:add"]) == [multiply, add]
    assert load_tools(["hf_rlhf.toy.tool_task:add", "hf_rlhf.toy.tool_task:multiply"]) == [add, multiply]
    assert load_tools(None) == [] and load_tools(["none"]) == []


@pytest.mark.parametrize("spec, message", [
    ("hf_rlhf.toy.tool_task", "package.module:function"),
    ("hf_rlhf.toy.no_such_module:f", "cannot import"),
    ("hf_rlhf.toy.tool_task:divide", "has no function 'divide'"),
    ("none,hf_rlhf.toy.tool_task:add", "no tools"),
])
def test_a_tool_that_cannot_be_resolved_is_a_one_line_error(spec, message):
    with pytest.raises(RecipeOptionError, match=message):
        load_tools([spec])


def test_the_recipe_parses_tools_from_the_command_line_and_a_config():
    from hf_rlhf import ModelConfig, PPOConfig
    from hf_rlhf.cli.arguments import parse_recipe_args
    from hf_rlhf.toy.chain import ToyChainArguments
    from recipes.ppo import TOY_CONFIG, ScriptArguments

    types = (ScriptArguments, ToyChainArguments, ModelConfig, PPOConfig)
    script, toy, *_ = parse_recipe_args(types, ["--config", CONFIG], TOY_CONFIG)
    assert load_tools(script.tools) == [multiply] and toy.toy_task == "tools"
    script, *_ = parse_recipe_args(types, ["--config", CONFIG, "--tools", "none"],
                                   TOY_CONFIG)
    assert load_tools(script.tools) == []
    script, *_ = parse_recipe_args(types, ["--tools", "hf_rlhf.toy.tool_task:add", "hf_rlhf.toy.tool_task:multiply"],
                                   TOY_CONFIG)
    assert load_tools(script.tools) == [add, multiply]
