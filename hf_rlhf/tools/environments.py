"""`environment_factory` environments (TRL 1.16 GRPOTrainer's meaning): one instance per rollout row, reset per
rollout, its public methods the row's tools, its optional `get_reward()` a reward source of its own.

As TRL: each factory is called once at start (a probe that checks `reset` and names the tools the prompts are
rendered with); instances are pooled and reused, each `reset(**row)` at the start of the rollout that uses it, so
two rows never share one (isolated state); a `reset` that returns a string has it appended to the row's last user
message. A dict `{name: factory}` routes each row by its `environment` field (not passed to `reset`); the row is then
rendered and run with that environment's tools only. Each environment class that defines `get_reward` is one reward
function (`reward_funcs()`), named after the class: it scores the rows of that class and returns None for the others.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from datasets import Dataset

from .execution import tool_dict

RESERVED = ("reset", "get_reward")
ROUTING_FIELD = "environment"  # a row's environment, with a dict of factories
PLACEHOLDER_PROMPT = [{"role": "user", "content": ""}]  # TRL's prompt of a row whose environment writes it (`reset`)


def environment_methods(instance) -> list[Callable]:
    """The instance's tools: its public functions other than `reset` and `get_reward` (listed on the class, as TRL
    does, so that properties are not evaluated)."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in RESERVED and not name.startswith("_")]


def environment_reward(env_type: type) -> Callable:
    """TRL's reward function of an environment class with `get_reward()`: `(environments, **kwargs) -> [float |
    None]`, None for the rows whose environment is not exactly that class; `async` when `get_reward` is."""
    if inspect.iscoroutinefunction(env_type.get_reward):
        async def get_reward(environments, **kwargs):
            return [await e.get_reward() if type(e) is env_type else None for e in environments]
    else:
        def get_reward(environments, **kwargs):
            return [e.get_reward() if type(e) is env_type else None for e in environments]
    get_reward.__name__ = get_reward.__qualname__ = env_type.__name__  # TRL's `reward_func_names` entry
    return get_reward


def placeholder_prompts(args, factory) -> Dataset:
    """TRL's training rows when the environment owns the data: one rollout's worth of empty user turns (each row's
    `reset()` returns its prompt), cycled for `max_steps` steps.

    Args:
        args: the trainer's config (`max_steps`, `prompts_per_rollout`, `world_size`).
        factory: the `environment_factory`, or its `EnvironmentPool` (a dict of several needs rows to route: refused).

    Raises:
        ValueError: a dict of environments (which row goes where?), or `max_steps` unset (a placeholder has no epochs).
    """
    names = list(factory.factories) if isinstance(factory, EnvironmentPool) and factory.multi else (
        list(factory) if isinstance(factory, dict) else None)
    if names is not None:
        raise ValueError("A `dict` `environment_factory` (multiple environments) requires a `train_dataset` with an "
                         f"`{ROUTING_FIELD}` column to route each row to its environment (one of {names}); "
                         "provide a dataset, or pass a single environment factory.")
    if args.max_steps is None or args.max_steps <= 0:
        raise ValueError("Training without a `train_dataset` (the environment owns the data and returns the prompt "
                         f"from `reset()`) needs max_steps > 0 to set the training length, got max_steps="
                         f"{args.max_steps}.")
    rows = args.prompts_per_rollout * max(args.world_size, 1)
    return Dataset.from_dict({"prompt": [PLACEHOLDER_PROMPT] * rows})


class EnvironmentPool:
    """Environment instances for the rows of each rollout.

    Args:
        factory: a no-argument callable returning an environment (a `reset` method required), or a dict
            `{name: factory}` selected by each row's `environment` field.
        tools: the standalone tools every row also has.

    Raises:
        ValueError: a factory is not callable, or its environment has no callable `reset`.
    """

    def __init__(self, factory, tools: list | None = None):
        self.multi = isinstance(factory, dict)
        factories = dict(factory) if self.multi else {None: factory}
        if not factories:
            raise ValueError("environment_factory is an empty dict: map at least one environment name to a factory")
        self.factories, self.tools = factories, list(tools or [])
        self.env_tools: dict = {}  # {name: the tools a row of that environment has} (TRL's `_env_tools`)
        self._pools: dict = {}
        self.reward_types: list[type] = []  # the classes with `get_reward`, one reward column each (deduplicated)
        template = {tool.__name__: tool for tool in self.tools}
        for name, make in factories.items():
            where = "environment_factory" if name is None else f"environment_factory[{name!r}]"
            if not callable(make):
                raise ValueError(f"{where} must be a callable returning an environment, got {make!r}")
            probe = make()
            if not callable(getattr(probe, "reset", None)):
                raise ValueError(f"the environment returned by {where} ({type(probe).__name__}) must define a "
                                 "callable `reset`")
            methods = environment_methods(probe)
            self.env_tools[name] = self.tools + methods
            tool_dict(self.env_tools[name])  # named callables, unique names
            for method in methods:
                template.setdefault(method.__name__, method)
            if callable(getattr(probe, "get_reward", None)) and type(probe) not in self.reward_types:
                self.reward_types.append(type(probe))
            self._pools[name] = [probe]
        self.has_reward = bool(self.reward_types)
        # every environment's tools, by name: what a single environment's prompts are rendered with, and `trainer.tools`
        self.template_tools = list(template.values())
        self.prompt_is_placeholder = False  # True: the rows' prompt is the empty one given for `reset()` to fill
        self._cursor: dict = {}

    def reward_funcs(self) -> list[Callable]:
        """One reward function per environment class with `get_reward` (`environment_reward`), in factory order."""
        return [environment_reward(env_type) for env_type in self.reward_types]

    def name_of(self, row: dict):
        """The row's environment name (None with a single factory); unknown names are for `check_rows`."""
        return row.get(ROUTING_FIELD) if self.multi else None

    def tools_for(self, row: dict) -> list:
        """The tools a row's prompt is rendered with: its environment's (the standalone ones for an unknown name)."""
        return self.env_tools.get(self.name_of(row), self.tools)

    def check_rows(self, rows: list[dict], indices: list[int] | None = None) -> None:
        """Every row names a known environment (with a dict of factories).

        Raises:
            ValueError: naming the row (its dataset index when given), its `environment` value and the known names.
        """
        if not self.multi:
            return
        for i, row in enumerate(rows):
            name = row.get(ROUTING_FIELD)
            if name not in self.factories:
                where = f"dataset row {indices[i]}" if indices is not None else f"row {i} of the rollout"
                raise ValueError(f"{where}: its `{ROUTING_FIELD}` field is {name!r}, which is not among the "
                                 f"environments passed to environment_factory; expected one of {list(self.factories)}")

    def new_rollout(self) -> None:
        """Every instance is free again (called at the start of each rollout)."""
        self._cursor = {}

    def take(self, rows: list[dict]) -> tuple[list, list[dict[str, Callable]], list]:
        """One fresh-reset instance per row, of the row's environment.

        Args:
            rows: the rows of a generation round (dataset fields; `input_ids`, the routing `environment` field and a
                placeholder prompt are not passed to `reset`).

        Returns:
            (instances, per-row {name: tool}, per-row `reset` observations: None or a string).
        """
        self.check_rows(rows)
        skip = {"input_ids"} | ({ROUTING_FIELD} if self.multi else set()) | (
            {"prompt"} if self.prompt_is_placeholder else set())
        instances, tool_sets, observations = [], [], []
        for row in rows:
            name = self.name_of(row)
            pool, used = self._pools[name], self._cursor.get(name, 0)
            if used == len(pool):
                pool.append(self.factories[name]())
            instance = pool[used]
            self._cursor[name] = used + 1
            observations.append(instance.reset(**{k: v for k, v in row.items() if k not in skip}))
            instances.append(instance)
            tool_sets.append(tool_dict(self.tools + environment_methods(instance)))
        return instances, tool_sets, observations
