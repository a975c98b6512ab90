"""The reward HTTP server under load on loopback (issue 44, item 4): concurrent clients for a bounded time, every
answer checked row by row, the server's memory, threads and file descriptors before and after.

    python bench/reward_server_load.py                               # 1, 8 and 32 clients, 10 s each
    python bench/reward_server_load.py --clients 4 --seconds 3 --batch 16

The server is `python -m hf_rlhf.rewards.server` in its own process, serving `echo_ids` (below): each row of a
request carries a unique `row_id` column and is scored with that id, so an answer proves which rows it scored.
The clients are threads of this process, each sending batches through `HTTPReward` (the trainers' client, no
retries: a failure is counted, not hidden) back to back until the time is up. Lost rows (sent, never scored),
duplicated ones (scored twice) and mixed ones (an answer whose scores are not the ids sent) are counted over every
answer. Latency is per request (one batch); throughput in requests and rows per second. Memory: the server's RSS
(/proc/<pid>/status) after a warm-up of one second at the same load, and after the run.

Prints one JSON line per concurrency level, then a markdown table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def echo_ids(prompts, completions, row_id, **columns) -> list[float]:
    """The server's reward: each row's `row_id`, after a little work on its completion (a digit count)."""
    for completion in completions:
        sum(ch.isdigit() for ch in completion)
    return [float(i) for i in row_id]


def server_stats(pid: int) -> dict:
    """RSS (MiB), threads and open file descriptors of process `pid`, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return {"rss_mib": round(int(fields["VmRSS"].split()[0]) / 1024, 1), "threads": int(fields["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "bench")])}
    server = subprocess.Popen([sys.executable, "-m", "hf_rlhf.rewards.server", "--port", str(port), "--reward",
                               "reward_server_load:echo_ids"], env=env, stdout=subprocess.PIPE, text=True)
    line = server.stdout.readline()
    if not line.startswith("serving "):
        server.kill()
        raise RuntimeError(f"the reward server did not start: {line!r}")
    return server, f"http://127.0.0.1:{port}/"


class Load:
    """`clients` threads sending `batch`-row requests back to back until `stop` is set; every answer is checked."""

    def __init__(self, url: str, clients: int, batch: int):
        from hf_rlhf.rewards.http_client import HTTPReward

        self.reward = HTTPReward(url, timeout=60.0, max_retries=0)
        self.clients, self.batch = clients, batch
        self.ids = itertools.count()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.recording = False
        self.latencies, self.sent, self.scored, self.errors, self.mixed = [], [], [], [], 0

    def _client(self):
        while not self.stop.is_set():
            with self.lock:
                ids = [next(self.ids) for _ in range(self.batch)]
            prompts = [f"{i % 97}+{i % 89}=" for i in ids]
            completions = [f"{i % 97 + i % 89}" for i in ids]
            start = time.perf_counter()
            try:
                scores = self.reward(prompts, completions, row_id=ids).tolist()
            except Exception as err:  # counted: the figure says how many requests failed and why
                with self.lock:
                    self.errors.append(f"{type(err).__name__}: {str(err)[:200]}")
                continue
            took = time.perf_counter() - start
            got = [int(s) for s in scores]
            with self.lock:
                if not self.recording:
                    continue
                self.latencies.append(took)
                self.sent.extend(ids)
                self.scored.extend(got)
                self.mixed += got != ids

    def run(self, seconds: float, warmup: float, on_warm) -> dict:
        threads = [threading.Thread(target=self._client, daemon=True) for _ in range(self.clients)]
        for t in threads:
            t.start()
        time.sleep(warmup)
        before = on_warm()
        with self.lock:
            self.recording = True
        start = time.perf_counter()
        time.sleep(seconds)
        with self.lock:
            self.recording = False
            elapsed = time.perf_counter() - start
        self.stop.set()
        for t in threads:
            t.join(timeout=120)
        return {"before": before, "elapsed": elapsed}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


def measure(clients: int, seconds: float, batch: int, warmup: float = 1.0) -> dict:
    server, url = start_server()
    try:
        load = Load(url, clients, batch)
        run = load.run(seconds, warmup, lambda: server_stats(server.pid))
        time.sleep(0.5)  # the server's last handler threads end
        after = server_stats(server.pid)
    finally:
        server.kill()
        server.wait()
    sent, scored = load.sent, load.scored
    lost = len(set(sent) - set(scored))
    duplicated = len(scored) - len(set(scored))
    n = len(load.latencies)
    return {"clients": clients, "batch": batch, "seconds": round(run["elapsed"], 2), "requests": n,
            "requests_per_s": round(n / run["elapsed"], 1), "rows_per_s": round(len(scored) / run["elapsed"], 1),
            "p50_ms": round(1000 * percentile(load.latencies, 0.5), 2),
            "p99_ms": round(1000 * percentile(load.latencies, 0.99), 2),
            "max_ms": round(1000 * max(load.latencies, default=float("nan")), 2),
            "rows_checked": len(scored), "lost": lost, "duplicated": duplicated, "mixed_answers": load.mixed,
            "errors": len(load.errors), "first_errors": sorted(set(load.errors))[:3],
            "server_before": run["before"], "server_after": after}


def table(results: list[dict]) -> str:
    lines = ["| clients | batch | req/s | rows/s | p50 ms | p99 ms | max ms | rows checked | lost | dup | errors | "
             "RSS MiB before → after | threads | fds |", "|" + "---|" * 14]
    for r in results:
        b, a = r["server_before"], r["server_after"]
        lines.append(f"| {r['clients']} | {r['batch']} | {r['requests_per_s']:,} | {r['rows_per_s']:,} | "
                     f"{r['p50_ms']} | {r['p99_ms']} | {r['max_ms']} | {r['rows_checked']:,} | {r['lost']} | "
                     f"{r['duplicated']} | {r['errors']} | {b['rss_mib']} → {a['rss_mib']} | "
                     f"{b['threads']} → {a['threads']} | {b['fds']} → {a['fds']} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="1,8,32", help="comma-separated concurrency levels")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured time per level (after 1 s warm-up)")
    parser.add_argument("--batch", type=int, default=16, help="rows per request")
    args = parser.parse_args(argv)
    results = []
    for clients in (int(c) for c in args.clients.split(",")):
        result = measure(clients, args.seconds, args.batch)
        print(json.dumps(result), flush=True)
        results.append(result)
    print(table(results))
    print(f"\npython bench/reward_server_load.py --clients {args.clients} --seconds {args.seconds:g} "
          f"--batch {args.batch}")
    return results


if __name__ == "__main__":
    main()
