"""`HTTPReward`: a PPO reward source served over HTTP (a remote reward model, a verifier), standard library only.

The protocol is in the class docstring; `hf_rlhf.rewards.server` is a reference server that speaks it.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from http.client import HTTPException

import torch

from .base import RewardError, check_scores, completion_text

logger = logging.getLogger("hf_rlhf")

_RETRIED_STATUS = (429, 500, 502, 503, 504)


class HTTPReward:
    """A reward endpoint: POST a JSON batch, read one score per completion.

    Protocol `"hf_rlhf"` (default)::

        POST <url>   Content-Type: application/json
        {"prompts":     [B prompts: strings, or message lists for conversational data],
         "completions": [B completions: strings, or [{"role": "assistant", "content": ...}]],
         "<column>":    [B values] for every other dataset column (e.g. "answer"), as reward functions get them}
        -> 200 {"scores": [B numbers]}          (other keys in the answer are ignored)

    Protocol `"openrlhf"`: OpenRLHF's remote reward model API (`openrlhf.cli.serve_rm`, `--remote_rm_url`)::

        {"query": [B prompt + completion texts], "prompts": [B prompt texts], "labels": [B row[label_field] or ""]}
        -> 200 {"rewards": [B numbers]}

    where conversational prompts are rendered with the tokenizer's chat template (`tokenizer`, default: the
    policy's).

    Failures: connection errors, timeouts and HTTP 429 / 5xx answers are retried `max_retries` times, waiting
    `backoff * 2**k` seconds before retry k; then a `RewardError` names the URL, the number of attempts and the
    last error. Another HTTP error, an answer that is not JSON or has no score list, a wrong number of scores,
    or a NaN / non-numeric score raise a `RewardError` at once.

    Args:
        url: `http://host:port/path` or `https://...`.
        timeout: seconds per request (connect and read).
        max_retries: retries after the first attempt.
        backoff: seconds before the first retry (doubled at each retry).
        headers: extra HTTP headers (e.g. {"Authorization": "Bearer ..."}).
        batch_size: completions per request (None: the whole rollout batch in one request).
        protocol: "hf_rlhf" or "openrlhf".
        score_key: the answer's score list (default: "scores", or "rewards" for "openrlhf").
        label_field: the dataset column sent as OpenRLHF's `labels`.
        tokenizer: renders conversational prompts for "openrlhf".
    """

    is_reward_source = True
    PROTOCOLS = ("hf_rlhf", "openrlhf")

    def __init__(self, url: str, timeout: float = 30.0, max_retries: int = 3, backoff: float = 0.5,
                 headers: dict | None = None, batch_size: int | None = None, protocol: str = "hf_rlhf",
                 score_key: str | None = None, label_field: str | None = None, tokenizer=None):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"reward endpoint URL must be http(s)://host[:port]/path, got {url!r}")
        if protocol not in self.PROTOCOLS:
            raise ValueError(f"protocol must be one of {self.PROTOCOLS}, got {protocol!r}")
        if timeout <= 0 or max_retries < 0 or backoff < 0 or (batch_size is not None and batch_size < 1):
            raise ValueError("HTTPReward needs timeout > 0, max_retries >= 0, backoff >= 0 and batch_size >= 1")
        self.url, self.timeout, self.max_retries, self.backoff = url, float(timeout), int(max_retries), backoff
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.batch_size, self.protocol, self.label_field, self.tokenizer = batch_size, protocol, label_field, tokenizer
        self.score_key = score_key or ("rewards" if protocol == "openrlhf" else "scores")
        # a loopback endpoint never goes through the environment's HTTP proxy
        proxies = {} if parts.hostname in ("localhost", "127.0.0.1", "::1") else None
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler(proxies))
        self.name = f"reward endpoint {url}"

    def __call__(self, prompts: list, completions: list, **row_fields) -> torch.Tensor:
        size = self.batch_size or max(len(completions), 1)
        scores = []
        for start in range(0, len(completions), size):
            end = start + size
            fields = {key: list(values)[start:end] for key, values in row_fields.items()}
            chunk = self._request(self._payload(prompts[start:end], completions[start:end], fields))
            if not isinstance(chunk, list) or len(chunk) != len(completions[start:end]):
                got = f"{len(chunk)} scores" if isinstance(chunk, list) else type(chunk).__name__
                raise RewardError(f"{self.name} returned {got} for {len(completions[start:end])} completions "
                                  f"(rows {start}..{min(end, len(completions)) - 1}); {self.score_key!r} must be a "
                                  "list with one number per completion")
            scores.extend(chunk)
        return check_scores(scores, len(completions), self.name, prompts, completions)

    def _payload(self, prompts, completions, fields) -> bytes:
        if self.protocol == "openrlhf":
            prompt_texts = [self._render(p) for p in prompts]
            queries = [self._render(p, completion_text(c)) if isinstance(p, list) else p + completion_text(c)
                       for p, c in zip(prompts, completions)]
            if self.label_field is not None and self.label_field not in fields:
                raise RewardError(f"{self.name}: label_field={self.label_field!r} is not a dataset column; columns: "
                                  f"{sorted(fields)}")
            labels = fields[self.label_field] if self.label_field is not None else [""] * len(prompts)
            data = {"query": queries, "prompts": prompt_texts, "labels": labels}
        else:
            data = {"prompts": prompts, "completions": completions, **fields}
        try:
            return json.dumps(data, default=_jsonable).encode()
        except (TypeError, ValueError) as err:
            for key, value in data.items():  # name the column at fault
                try:
                    json.dumps(value, default=_jsonable)
                except (TypeError, ValueError):
                    raise RewardError(f"{self.name}: dataset column {key!r} cannot be sent as JSON ({err}); remove "
                                      "it from the prompt dataset or make it JSON-serializable") from None
            raise

    def _render(self, prompt, completion: str | None = None) -> str:
        if not isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise RewardError(f"{self.name}: protocol 'openrlhf' sends text; conversational prompts need a "
                              "tokenizer with a chat template (HTTPReward(..., tokenizer=...))")
        if completion is None:
            return self.tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
        messages = list(prompt) + [{"role": "assistant", "content": completion}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    def _request(self, body: bytes):
        """POST `body` with retries; the answer's score list (not yet checked)."""
        attempts, last_error = self.max_retries + 1, None
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
            try:
                with self._opener.open(request, timeout=self.timeout) as response:
                    raw = response.read()
            except urllib.error.HTTPError as err:
                detail = err.read()[:300].decode("utf-8", "replace")
                last_error = f"HTTP {err.code} {err.reason}: {detail!r}"
                if err.code in _RETRIED_STATUS:
                    logger.warning("%s: attempt %d/%d failed (%s)", self.name, attempt + 1, attempts, last_error)
                    continue
                raise RewardError(f"{self.name} answered {last_error}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError, HTTPException, OSError) as err:
                reason = getattr(err, "reason", err)
                last_error = f"{type(reason).__name__}: {reason}"
                logger.warning("%s: attempt %d/%d failed (%s)", self.name, attempt + 1, attempts, last_error)
                continue
            try:
                answer = json.loads(raw)
            except ValueError:
                raise RewardError(f"{self.name} answered with a body that is not JSON: {raw[:200]!r}") from None
            if not isinstance(answer, dict) or self.score_key not in answer:
                raise RewardError(f"{self.name} answered {str(answer)[:200]}; expected a JSON object with "
                                  f"{self.score_key!r}: [one number per completion]")
            return answer[self.score_key]
        raise RewardError(f"{self.name} failed after {attempts} attempts (1 + max_retries={self.max_retries}, "
                          f"timeout={self.timeout}s); last error: {last_error}")


def _jsonable(value):
    if hasattr(value, "tolist"):  # tensors, numpy arrays and scalars
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
