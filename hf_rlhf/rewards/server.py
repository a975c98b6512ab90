"""A reward function served over HTTP with `HTTPReward`'s protocol: the reference server (standard library only).

    POST {"prompts": [...], "completions": [...], "<column>": [...]}  ->  200 {"scores": [...]}

A body that is not a JSON object with `prompts` and `completions` gets 400; an exception in the reward function
gets 500 with its message (which `HTTPReward` retries). Threaded, so a slow request does not block the next.

    python -m hf_rlhf.rewards.server --port 8000 --reward hf_rlhf.toy:reward_fn

or in Python (tests, notebooks)::

    with RewardServer(reward_fn) as server:        # 127.0.0.1, a free port
        trainer = PPOTrainer(model, server.url, ...)
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

logger = logging.getLogger("hf_rlhf")


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self):  # noqa: N802 (http.server's name)
        length = int(self.headers.get("Content-Length") or 0)
        try:
            data = json.loads(self.rfile.read(length))
            prompts, completions = data.pop("prompts"), data.pop("completions")
        except (ValueError, KeyError, AttributeError, TypeError):
            return self._answer(400, {"error": "expected a JSON object with 'prompts' and 'completions'"})
        try:
            scores = self.server.reward_fn(prompts=prompts, completions=completions, **data)
            scores = [float(s) for s in scores]
        except Exception as err:  # the client sees the reason and may retry
            logger.exception("reward function failed")
            return self._answer(500, {"error": f"{type(err).__name__}: {err}"})
        self._answer(200, {"scores": scores})

    def _answer(self, status: int, body: dict) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, format, *args):  # quiet by default: one line per request at DEBUG
        logger.debug("reward server: " + format, *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's listen backlog is 5: with 32 clients on loopback, connections were reset (19 of ~2,900
    # requests in 2 s) and others waited for the kernel's 1 s SYN retry (max 1.25 s, p99 0.1 s):
    # bench/reward_server_load.py
    request_queue_size = 1024
    reward_fn: Callable


class RewardServer:
    """Serve `reward_fn(prompts=..., completions=..., **columns) -> list[float]` on `http://host:port/`.

    Args:
        reward_fn: the reward function (as for `FunctionReward`).
        host: the address to bind (default loopback only).
        port: 0 picks a free port; read it back from `url`.
    """

    def __init__(self, reward_fn: Callable, host: str = "127.0.0.1", port: int = 0):
        self._server = _Server((host, port), _Handler)
        self._server.reward_fn = reward_fn
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/"

    def start(self) -> RewardServer:
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()

    def __enter__(self) -> RewardServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Serve a Python reward function over HTTP (HTTPReward protocol).")
    parser.add_argument("--reward", default="hf_rlhf.toy:reward_fn", help="module:function")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    module, _, name = args.reward.partition(":")
    server = RewardServer(getattr(importlib.import_module(module), name), args.host, args.port)
    print(f"serving {args.reward} on {server.url}", flush=True)
    try:
        server._server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server._server.server_close()


if __name__ == "__main__":
    main()
