"""`environment_factory` environments (TRL 1.16 GRPOTrainer's meaning): one instance per rollout row, reset per
rollout, its public methods the row's tools, its optional `get_reward()` a reward alongside the reward functions.

As TRL: the factory is called once at start (a probe that checks `reset` and names the tools the prompts are
rendered with); instances are pooled and reused, each `reset(**row)` at the start of the rollout that uses it, so
two rows never share one (isolated state); a `reset` that returns a string has it appended to the row's last user
message. Unlike TRL, a dict of several named environments is not supported (one factory).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from .execution import tool_dict

RESERVED = ("reset", "get_reward")


def environment_methods(instance) -> list[Callable]:
    """The instance's tools: its public functions other than `reset` and `get_reward` (listed on the class, as TRL
    does, so that properties are not evaluated)."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in RESERVED and not name.startswith("_")]


class EnvironmentPool:
    """Environment instances for the rows of each rollout.

    Args:
        factory: a no-argument callable returning an environment (a `reset` method required).
        tools: the standalone tools every row also has.

    Raises:
        ValueError: the factory is not callable, or its environment has no callable `reset`.
    """

    def __init__(self, factory: Callable, tools: list | None = None):
        if not callable(factory) or isinstance(factory, dict):
            raise ValueError("environment_factory must be a callable returning an environment (a dict of several "
                             "environments is not supported)")
        self.factory, self.tools = factory, list(tools or [])
        probe = factory()
        if not callable(getattr(probe, "reset", None)):
            raise ValueError(f"the environment returned by environment_factory ({type(probe).__name__}) must define "
                             "a callable `reset`")
        self.has_reward = callable(getattr(probe, "get_reward", None))
        self.name = type(probe).__name__  # TRL's name of its reward (`reward_func_names`)
        self.template_tools = self.tools + environment_methods(probe)  # what the prompts are rendered with
        tool_dict(self.template_tools)
        self._pool, self._cursor = [probe], 0

    def new_rollout(self) -> None:
        """Every instance is free again (called at the start of each rollout)."""
        self._cursor = 0

    def take(self, rows: list[dict]) -> tuple[list, list[dict[str, Callable]], list]:
        """One fresh-reset instance per row.

        Args:
            rows: the rows of a generation round (dataset fields; `input_ids` is not passed to `reset`).

        Returns:
            (instances, per-row {name: tool}, per-row `reset` observations: None or a string).
        """
        instances, tool_sets, observations = [], [], []
        for row in rows:
            if self._cursor == len(self._pool):
                self._pool.append(self.factory())
            instance = self._pool[self._cursor]
            self._cursor += 1
            observations.append(instance.reset(**{k: v for k, v in row.items() if k != "input_ids"}))
            instances.append(instance)
            tool_sets.append(tool_dict(self.tools + environment_methods(instance)))
        return instances, tool_sets, observations
