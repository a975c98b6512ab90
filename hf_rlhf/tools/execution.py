"""Running a turn's tool calls: concurrently in a bounded thread pool, each failure turned into a message.

As TRL 1.16's GRPOTrainer (`_tool_call_loop`): a call runs as `tool(**arguments)`; its result becomes a tool message
`{"role": "tool", "name": name, "content": str(result)}`, and an exception, an unknown tool name or a call that is
not a function becomes `{"error": "..."}` as content, which the policy reads at its next turn. Unlike TRL, every
call of a turn shares one deadline (`timeout` seconds after the turn's calls were submitted); a call past it is
answered with a timeout error. Python cannot stop a thread: a call that never returns keeps its worker, so the pool
has `max_workers` of them and a later turn may wait for a free one (its calls then time out too, never hang the run).
"""

from __future__ import annotations

import asyncio
import inspect
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable


def tool_dict(tools) -> dict[str, Callable]:
    """{function name: callable} for a list of tools (functions or bound methods)."""
    out = {}
    for tool in tools or []:
        name = getattr(tool, "__name__", None)
        if not callable(tool) or not name:
            raise ValueError(f"a tool must be a named function or method, got {tool!r}")
        out[name] = tool
    return out


def _call(function: Callable, arguments: dict):
    if inspect.iscoroutinefunction(function):
        return asyncio.run(function(**arguments))
    return function(**arguments)


class ToolRunner:
    """A bounded pool that runs the tool calls of one turn of a rollout batch.

    Args:
        max_workers: threads of the pool.
        timeout: seconds a turn's calls may take together (None: no limit).
    """

    def __init__(self, max_workers: int = 8, timeout: float | None = 30.0):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers, self.timeout = max_workers, timeout
        self._pool = None

    def run(self, calls: list[tuple[dict, dict[str, Callable]]]) -> list[tuple[str, str, bool]]:
        """Run `calls`, each (a parsed tool call, the tools of its row), in order of the list.

        Returns:
            one (tool name, message content, failed) per call, in the same order.
        """
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="hf_rlhf-tool")
        results: list = [None] * len(calls)
        futures = {}
        for i, (call, tools) in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            if call.get("type", "function") != "function" or not isinstance(name, str):
                results[i] = (str(name or "unknown"), str({"error": f"Unsupported tool call: {call!r}"}), True)
            elif name not in tools:
                results[i] = (name, str({"error": f"Tool {name} not found."}), True)
            else:
                arguments = function.get("arguments") or {}
                if not isinstance(arguments, dict):
                    results[i] = (name, str({"error": f"arguments must be an object, got {arguments!r}"}), True)
                else:
                    futures[self._pool.submit(_call, tools[name], arguments)] = (i, name)
        done, pending = wait(futures, timeout=self.timeout)
        for future in pending:
            future.cancel()
            i, name = futures[future]
            results[i] = (name, str({"error": f"Tool {name} timed out after {self.timeout} s."}), True)
        for future in done:
            i, name = futures[future]
            try:
                result = future.result()
            except Exception as err:  # noqa: BLE001 - any failure of a tool is the policy's to read, not a crash
                results[i] = (name, str({"error": f"{type(err).__name__}: {err}"}), True)
            else:
                results[i] = (name, str(result), False)
        return results

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
