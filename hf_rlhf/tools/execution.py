"""Running a turn's tool calls: concurrently on a bounded number of threads, each failure turned into a message.

As TRL 1.16's GRPOTrainer (`_tool_call_loop`): a call runs as `tool(**arguments)`; its result becomes a tool message
`{"role": "tool", "name": name, "content": str(result)}`, and an exception, an unknown tool name or a call that is
not a function becomes `{"error": "..."}` as content, which the policy reads at its next turn. Unlike TRL, every
call of a turn shares one deadline (`timeout` seconds after the turn's calls start); a call past it is answered with
a timeout error. Python cannot stop a thread: a call that never returns keeps its slot, so at most `max_workers`
calls run at once and a later call may wait for a free slot (and then time out too, never hang the run). The
threads are daemons, so a hung tool does not keep the process from exiting either (a `ThreadPoolExecutor` would:
its workers are joined at interpreter exit).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable


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
    """Runs the tool calls of one turn of a rollout batch, at most `max_workers` at once.

    Args:
        max_workers: calls running at once (threads).
        timeout: seconds a turn's calls may take together (None: no limit).
    """

    def __init__(self, max_workers: int = 8, timeout: float | None = 30.0):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers, self.timeout = max_workers, timeout
        self._slots = threading.BoundedSemaphore(max_workers)

    def _remaining(self, deadline):
        return None if deadline is None else max(deadline - time.monotonic(), 0.0)

    def _start(self, function: Callable, arguments: dict) -> tuple[threading.Thread, dict]:
        box: dict = {}

        def target():
            try:
                box["result"] = _call(function, arguments)
            except BaseException as err:  # noqa: BLE001 - any failure of a tool is the policy's to read
                box["error"] = err
            finally:
                self._slots.release()

        thread = threading.Thread(target=target, name="hf_rlhf-tool", daemon=True)
        thread.start()
        return thread, box

    def run(self, calls: list[tuple[dict, dict[str, Callable]]]) -> list[tuple[str, str, bool]]:
        """Run `calls`, each (a parsed tool call, the tools of its row).

        Returns:
            one (tool name, message content, failed) per call, in the order of `calls`.
        """
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        timed_out = "Tool {} timed out after {} s."
        results: list = [None] * len(calls)
        running = []
        for i, (call, tools) in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            arguments = (function.get("arguments") or {}) if isinstance(function, dict) else None
            if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(name, str):
                results[i] = (str(name or "unknown"), str({"error": f"Unsupported tool call: {call!r}"}), True)
            elif name not in tools:
                results[i] = (name, str({"error": f"Tool {name} not found."}), True)
            elif not isinstance(arguments, dict):
                results[i] = (name, str({"error": f"arguments must be an object, got {arguments!r}"}), True)
            elif not self._slots.acquire(timeout=self._remaining(deadline)):  # every slot held by a hung call
                results[i] = (name, str({"error": timed_out.format(name, self.timeout)}), True)
            else:
                running.append((i, name) + self._start(tools[name], arguments))
        for i, name, thread, box in running:
            thread.join(self._remaining(deadline))
            if thread.is_alive():
                results[i] = (name, str({"error": timed_out.format(name, self.timeout)}), True)
            elif "error" in box:
                err = box["error"]
                results[i] = (name, str({"error": f"{type(err).__name__}: {err}"}), True)
            else:
                results[i] = (name, str(box["result"]), False)
        return results

    def close(self) -> None:
        """Nothing to release (threads are per call); kept so callers can end a runner explicitly."""
