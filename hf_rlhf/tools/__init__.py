"""Tool calls in rollouts (issue 21): parsing a turn with the chat template's tool format, running the calls in a
bounded thread pool, and the masks that keep the environment's tokens in the context but out of the loss.

`masks` is math (torch only); `parsing`, `execution` and `environments` (`environment_factory` instances) are
data-layer helpers (tokenizer, Python callables). The turn loop that uses them lives in `hf_rlhf.rollout.multiturn`.
"""

from .execution import ToolRunner, tool_dict
from .masks import pack_turns
from .parsing import check_tool_tokenizer, parse_turn, rollout_tokenizer, tool_suffix_ids

__all__ = ["ToolRunner", "check_tool_tokenizer", "pack_turns", "parse_turn", "rollout_tokenizer", "tool_dict",
           "tool_suffix_ids"]
