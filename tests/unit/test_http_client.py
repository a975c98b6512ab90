"""`HTTPReward` against real HTTP servers on 127.0.0.1: protocol, batching, retries, clear errors (loopback only)."""

import json
import re
import socket
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from hf_rlhf.rewards.base import RewardError
from hf_rlhf.rewards.factory import build_reward_source
from hf_rlhf.rewards.http_client import HTTPReward
from hf_rlhf.rewards.server import RewardServer
from hf_rlhf.toy import prompt_dataset, reward_fn

ROWS = prompt_dataset(5, seed=0)
PROMPTS, ANSWERS = list(ROWS["prompt"]), list(ROWS["answer"])
COMPLETIONS = [ANSWERS[0], "wrong", ANSWERS[2], "", ANSWERS[4] + "x"]


class _Received(list):
    url: str


@contextmanager
def scripted_server(*answers):
    """A server that answers the i-th POST with answers[i] = (status, body); the last answer repeats.

    Yields the list of decoded request bodies it received.
    """
    received = _Received()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            status, body = answers[min(len(received), len(answers)) - 1]
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        received.url = f"http://127.0.0.1:{server.server_address[1]}/score"
        yield received
    finally:
        server.shutdown()
        thread.join(timeout=5)
        server.server_close()


def _closed_port() -> int:
    with socket.socket() as sock:  # bound, then closed: nothing listens there
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def toy_server():
    calls = []

    def recording(prompts, completions, **columns):
        calls.append({"prompts": prompts, "completions": completions, **columns})
        return reward_fn(prompts, completions, **columns)

    with RewardServer(recording) as server:
        server.calls = calls
        yield server


def test_scores_equal_the_reward_function_and_columns_arrive(toy_server):
    source = build_reward_source(toy_server.url)  # a URL string is an HTTPReward with its defaults
    assert isinstance(source, HTTPReward)
    scores = source(PROMPTS, COMPLETIONS, answer=ANSWERS)
    expected = torch.tensor(reward_fn(PROMPTS, COMPLETIONS, answer=ANSWERS))
    torch.testing.assert_close(scores, expected)
    assert scores.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert toy_server.calls == [{"prompts": PROMPTS, "completions": COMPLETIONS, "answer": ANSWERS}]


def test_batch_size_splits_the_rollout_into_requests_in_order(toy_server):
    scores = HTTPReward(toy_server.url, batch_size=2)(PROMPTS, COMPLETIONS, answer=ANSWERS)
    assert scores.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert [len(call["prompts"]) for call in toy_server.calls] == [2, 2, 1]
    assert [a for call in toy_server.calls for a in call["answer"]] == ANSWERS


def test_conversational_rows_are_sent_as_messages(toy_server):
    rows = prompt_dataset(2, seed=3, conversational=True)
    completions = [[{"role": "assistant", "content": a}] for a in rows["answer"]]
    scores = HTTPReward(toy_server.url)(list(rows["prompt"]), completions, answer=list(rows["answer"]))
    assert scores.tolist() == [1.0, 1.0]
    assert toy_server.calls[0]["completions"] == completions


def test_a_server_error_then_success_is_retried():
    with scripted_server((500, {"error": "warming up"}), (200, {"scores": [0.5] * 5})) as received:
        scores = HTTPReward(received.url, backoff=0.01)(PROMPTS, COMPLETIONS)
    assert scores.tolist() == [0.5] * 5 and len(received) == 2


def test_an_exception_in_the_served_function_is_a_500_that_is_retried():
    failures = [1]

    def flaky(prompts, completions, **kwargs):
        if failures:
            failures.pop()
            raise RuntimeError("transient")
        return [1.0] * len(completions)

    with RewardServer(flaky) as server:
        assert HTTPReward(server.url, backoff=0.01)(PROMPTS, COMPLETIONS).tolist() == [1.0] * 5


def test_an_unreachable_endpoint_fails_fast_naming_url_and_attempts():
    url = f"http://127.0.0.1:{_closed_port()}/score"
    source = HTTPReward(url, timeout=1.0, max_retries=2, backoff=0.01)
    start = time.monotonic()
    with pytest.raises(RewardError, match=rf"reward endpoint {url} failed after 3 attempts \(1 \+ max_retries=2, "
                                          r"timeout=1.0s\); last error: ConnectionRefusedError"):
        source(PROMPTS, COMPLETIONS)
    assert time.monotonic() - start < 5


def test_a_persistent_server_error_gives_up_with_the_last_status():
    with scripted_server((503, {"error": "overloaded"})) as received:
        with pytest.raises(RewardError, match=r"failed after 2 attempts .* last error: HTTP 503 .*overloaded"):
            HTTPReward(received.url, max_retries=1, backoff=0.01)(PROMPTS, COMPLETIONS)
    assert len(received) == 2


def test_a_slow_server_times_out_and_is_retried():
    class Slow(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            time.sleep(0.6)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        with pytest.raises(RewardError, match=r"failed after 2 attempts .*timeout=0.2s.*last error: .*timed out"):
            HTTPReward(url, timeout=0.2, max_retries=1, backoff=0.0)(PROMPTS, COMPLETIONS)
    finally:
        server.shutdown()
        thread.join(timeout=5)
        server.server_close()


@pytest.mark.parametrize("status, body, message", [
    (200, {"scores": [1.0, 2.0]}, r"returned 2 scores for 5 completions \(rows 0\.\.4\)"),
    (200, {"scores": [0.0, float("nan"), 0.0, 0.0, 0.0]}, r"returned nan for row 1 \(prompt .*\); scores must be"),
    (200, {"scores": [0.0, "high", 0.0, 0.0, 0.0]}, r"returned 'high' for row 1, expected a number"),
    (200, {"rewards": [0.0] * 5}, r"expected a JSON object with 'scores'"),
    (200, b"<html>proxy error</html>", r"a body that is not JSON"),
    (404, {"error": "no such path"}, r"answered HTTP 404 .*no such path"),
])
def test_bad_answers_raise_clear_errors_without_retrying(status, body, message):
    with scripted_server((status, body)) as received:
        with pytest.raises(RewardError, match=rf"reward endpoint {re.escape(received.url)} .*{message}"):
            HTTPReward(received.url, max_retries=3, backoff=0.01)(PROMPTS, COMPLETIONS)
    assert len(received) == 1  # only transient failures are retried


def test_openrlhf_protocol_sends_query_prompts_labels_and_reads_rewards():
    with scripted_server((200, {"rewards": [0.25] * 5, "extra_logs": {}})) as received:
        source = HTTPReward(received.url, protocol="openrlhf", label_field="answer", headers={"X-Key": "k"})
        scores = source(PROMPTS, COMPLETIONS, answer=ANSWERS)
    assert scores.tolist() == [0.25] * 5
    assert received[0] == {"query": [p + c for p, c in zip(PROMPTS, COMPLETIONS)], "prompts": PROMPTS,
                           "labels": ANSWERS}


def test_openrlhf_protocol_renders_chat_prompts_with_the_tokenizer():
    from hf_rlhf.toy import build_toy_tokenizer

    tokenizer = build_toy_tokenizer()
    rows = prompt_dataset(2, seed=3, conversational=True)
    completions = [[{"role": "assistant", "content": "7"}]] * 2
    with scripted_server((200, {"rewards": [0.0, 1.0]})) as received:
        HTTPReward(received.url, protocol="openrlhf", tokenizer=tokenizer)(list(rows["prompt"]), completions)
    prompt = tokenizer.apply_chat_template(rows["prompt"][0], tokenize=False, add_generation_prompt=True)
    assert received[0]["prompts"][0] == prompt and received[0]["query"][0].startswith(prompt)
    assert received[0]["labels"] == ["", ""]


def test_configuration_and_payload_errors():
    with pytest.raises(ValueError, match="must be http"):
        HTTPReward("ftp://127.0.0.1/score")
    with pytest.raises(ValueError, match="protocol must be one of"):
        HTTPReward("http://127.0.0.1:1/", protocol="grpc")
    with pytest.raises(RewardError, match="dataset column 'blob' cannot be sent as JSON"):
        HTTPReward("http://127.0.0.1:1/")(PROMPTS[:1], COMPLETIONS[:1], blob=[object()])
    with pytest.raises(RewardError, match=r"label_field='gold' is not a dataset column; columns: \['answer'\]"):
        HTTPReward("http://127.0.0.1:1/", protocol="openrlhf", label_field="gold")(PROMPTS, COMPLETIONS, answer=ANSWERS)
