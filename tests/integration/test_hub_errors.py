"""A model, tokenizer or reward model by hub id that cannot be had is one line naming the id, what was tried and
what to do (issue 45): with the network unreachable (HF_ENDPOINT at a closed loopback port, HF_HUB_OFFLINE unset:
a connection is refused at once, as a machine without network refuses it) and with HF_HUB_OFFLINE=1 (the suite's
own setting, tests/conftest.py), through the trainers, the recipes and the `hf-rlhf` command.
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

import hf_rlhf.models.loading
from hf_rlhf import DPOConfig, DPOTrainer, ModelConfig, SFTConfig, SFTTrainer
from hf_rlhf.cli.main import main
from hf_rlhf.models.loading import ModelUnavailableError, hub_errors, hub_failure, load_tokenizer
from hf_rlhf.toy import preference_dataset, sft_dataset
from hf_rlhf.trainers.ppo_config import PPOConfig
from hf_rlhf.trainers.ppo_trainer import PPOTrainer
from recipes import ppo as ppo_recipe

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL, RM = "some-org/some-model", "some-org/some-rm"
WHAT_TO_DO = ("Pass a local directory, or download it where the Hub is reachable (`hf download {id}`) and load the "
              "cached copy with HF_HUB_OFFLINE=1")


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed): a connection to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def unreachable_hub(monkeypatch):
    """The Hub as a machine without network sees it, in this process (huggingface_hub read HF_ENDPOINT and
    HF_HUB_OFFLINE into its constants at import) and for the processes a test starts (the environment).

    Returns:
        the endpoint, http://127.0.0.1:<closed port>.
    """
    from huggingface_hub import constants

    endpoint = f"http://127.0.0.1:{closed_port()}"
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    return endpoint


def unreachable_line(what: str, repo: str, endpoint: str) -> str:
    """The start of the message for `repo` on an unreachable Hub (the refused connection's text follows)."""
    return (f"{what} {repo!r} not found: no such local directory, not in the local hub cache, and the Hub at "
            f"{endpoint} cannot be reached (ConnectError: ")


def offline_line(what: str, repo: str) -> str:
    return (f"{what} {repo!r} not found: no such local directory, and not in the local hub cache (HF_HUB_OFFLINE is "
            f"set, so the Hub is not asked). " + WHAT_TO_DO.format(id=repo))


def assert_one_line(message: str, start: str) -> None:
    assert "\n" not in message
    assert message.startswith(start), message


def sft_args(tmp_path):
    return SFTConfig(output_dir=str(tmp_path / "out"), max_steps=1, report_to="none", max_length=64)


# --- the trainers ---------------------------------------------------------------------------------------------


def test_sft_trainer_on_an_unreachable_hub_is_one_line_at_once(tmp_path, tokenizer, unreachable_hub):
    start = time.perf_counter()
    with pytest.raises(ModelUnavailableError) as e:
        SFTTrainer(MODEL, sft_args(tmp_path), train_dataset=sft_dataset(4), processing_class=tokenizer)
    elapsed = time.perf_counter() - start
    message = str(e.value)
    assert_one_line(message, unreachable_line("model", MODEL, unreachable_hub))
    assert message.endswith("). " + WHAT_TO_DO.format(id=MODEL) + "; a gated or private repo also needs "
                            "`hf auth login` (or HF_TOKEN)")
    assert e.value.kind == "unreachable" and isinstance(e.value, FileNotFoundError)
    # one HEAD request, no retries: huggingface_hub's own backoff takes ~25 s per file (1+2+4+8+8 s)
    assert elapsed < 15, elapsed


def test_sft_trainer_offline_names_the_cache(tmp_path, tokenizer):
    with pytest.raises(ModelUnavailableError) as e:
        SFTTrainer(MODEL, sft_args(tmp_path), train_dataset=sft_dataset(4), processing_class=tokenizer)
    assert str(e.value) == offline_line("model", MODEL) and e.value.kind == "offline"


def test_a_tokenizer_by_hub_id_on_an_unreachable_hub(unreachable_hub):
    with pytest.raises(ModelUnavailableError) as e:
        load_tokenizer(ModelConfig(model_name_or_path=MODEL))
    assert_one_line(str(e.value), unreachable_line("model", MODEL, unreachable_hub))


def test_the_dpo_reference_by_hub_id_fails_before_the_policy_loads(tmp_path, tokenizer, unreachable_hub,
                                                                   monkeypatch):
    monkeypatch.setattr("hf_rlhf.trainers.dpo_trainer.resolve_model", policy_loaded)
    args = DPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, report_to="none")
    with pytest.raises(ModelUnavailableError) as e:
        DPOTrainer(MODEL + "-policy", ref_model=MODEL, args=args, train_dataset=preference_dataset(4),
                   processing_class=tokenizer)
    assert_one_line(str(e.value), unreachable_line("reference model", MODEL, unreachable_hub))


def policy_loaded(*args, **kwargs):
    raise AssertionError("the policy was loaded before the path that cannot be was refused")


@pytest.mark.parametrize("online", [True, False], ids=["unreachable", "offline"])
def test_a_ppo_reward_model_by_hub_id_fails_before_the_policy_loads(tmp_path, tiny_model_dir, prompts, request,
                                                                     monkeypatch, online):
    endpoint = request.getfixturevalue("unreachable_hub") if online else None
    monkeypatch.setattr("hf_rlhf.trainers.ppo_trainer.resolve_model", policy_loaded)
    args = PPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, report_to="none")
    with pytest.raises(ModelUnavailableError) as e:
        PPOTrainer(str(tiny_model_dir), RM, args=args, train_dataset=prompts)
    if online:
        assert_one_line(str(e.value), unreachable_line("reward model", RM, endpoint))
    else:
        assert str(e.value) == offline_line("reward model", RM)


class FakeHub(BaseHTTPRequestHandler):
    """A Hub that answers every file HEAD as the Hub does for a repo it does not have (or that is private: 401
    RepoNotFound) or one that is gated and not granted (403 GatedRepo)."""

    def do_HEAD(self):  # http.server calls it by this name
        gated = "gated" in self.path
        self.send_response(403 if gated else 401)
        self.send_header("X-Error-Code", "GatedRepo" if gated else "RepoNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_hub(unreachable_hub, monkeypatch):
    """`unreachable_hub` with a `FakeHub` listening on its port: the endpoint."""
    from huggingface_hub import constants

    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    yield endpoint
    server.shutdown()
    server.server_close()


def test_a_repo_the_hub_does_not_have_or_gates_is_one_line_with_the_login(fake_hub):
    with pytest.raises(ModelUnavailableError) as e:
        load_tokenizer(ModelConfig(model_name_or_path=MODEL))
    assert_one_line(str(e.value), f"model {MODEL!r} not found: no such local directory, not in the local hub cache, "
                                  f"and the Hub at {fake_hub} has no such repo, or it is private or gated (")
    assert str(e.value).endswith("Check the id, or log in with `hf auth login` (or HF_TOKEN)")
    assert e.value.kind == "no_repo"
    with pytest.raises(ModelUnavailableError) as e:
        load_tokenizer(ModelConfig(model_name_or_path="some-org/gated-model"))
    assert_one_line(str(e.value), f"model 'some-org/gated-model' is a gated repo on the Hub at {fake_hub} (")
    assert "log in with `hf auth login` (or HF_TOKEN)" in str(e.value) and e.value.kind == "gated"


# --- hub_errors: what from_pretrained raises, read down its chain ---------------------------------------------------


@pytest.fixture
def no_backoff(monkeypatch):
    """huggingface_hub's retries without their sleeps (1+2+4+8+8 s per file): a failing download fails at once."""
    from huggingface_hub.utils import _http

    monkeypatch.setattr(_http, "time", types.SimpleNamespace(sleep=lambda seconds: None))


def test_from_pretrained_on_an_unreachable_hub_becomes_one_line(unreachable_hub, no_backoff):
    # check=False: the check before the load is left out, so the line is made from from_pretrained's own error
    # (transformers' OSError, from huggingface_hub's LocalEntryNotFoundError, from the client's ConnectError)
    with pytest.raises(ModelUnavailableError) as e, hub_errors(MODEL, check=False):
        AutoModelForCausalLM.from_pretrained(MODEL)
    assert_one_line(str(e.value), f"model {MODEL!r} not found: no such local directory, not in the local hub cache, "
                                  f"and the Hub at {unreachable_hub} cannot be reached (")
    assert e.value.kind == "unreachable"
    assert type(e.value.__cause__).__name__ == "OSError"  # transformers' own, kept as the cause


def test_from_pretrained_offline_becomes_one_line():
    with pytest.raises(ModelUnavailableError) as e, hub_errors(MODEL, check=False):
        AutoConfig.from_pretrained(MODEL)
    assert str(e.value) == offline_line("model", MODEL)


def test_other_errors_pass_through_unchanged(tiny_model_dir):
    with pytest.raises(ValueError, match="^not a hub failure$"), hub_errors(str(tiny_model_dir)):
        raise ValueError("not a hub failure")
    assert hub_failure(OSError("a disk error")) is None


def test_hub_failures_are_read_from_the_exception_chain():
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    def chain(*errors):
        """errors[0] raised from errors[1], raised from errors[2], ..."""
        for outer, inner in zip(errors, errors[1:]):
            outer.__cause__ = inner
        return errors[0]

    refused = chain(OSError("We couldn't connect"), LocalEntryNotFoundError("not in the cache"),
                    ConnectionRefusedError(111, "Connection refused"))
    assert hub_failure(refused)[0] == "unreachable"
    assert hub_failure(chain(OSError("x"), socket.gaierror(-2, "Name or service not known")))[0] == "unreachable"
    assert hub_failure(chain(OSError("x"), TimeoutError("timed out")))[0] == "unreachable"
    assert hub_failure(chain(OSError("x"), OfflineModeIsEnabled("offline")))[0] == "offline"
    # a cache miss with its cause left out: offline when HF_HUB_OFFLINE is set (the suite's setting)
    assert hub_failure(chain(OSError("x"), LocalEntryNotFoundError("not in the cache")))[0] == "offline"


# --- the recipes and the `hf-rlhf` command ----------------------------------------------------------------------


def test_hf_rlhf_sft_on_an_unreachable_hub_is_one_line(unreachable_hub, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["sft", "--model_name_or_path", MODEL, "--toy_train_size", "8", "--toy_test_size", "4",
              "--output_dir", str(tmp_path / "out")])
    assert_one_line(str(e.value), "[hf_rlhf] error: " + unreachable_line("model", MODEL, unreachable_hub))


def test_hf_rlhf_ppo_refuses_a_reward_model_before_anything_loads(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(ppo_recipe, "load_prompt_data", policy_loaded)
    monkeypatch.setattr(ppo_recipe, "PPOTrainer", policy_loaded)
    monkeypatch.setattr(hf_rlhf.models.loading, "load_model", policy_loaded)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(4)))
    with pytest.raises(SystemExit) as e:
        main(["ppo", "--dataset_name", str(data), "--model_name_or_path", str(tiny_model_dir),
              "--reward_model_path", RM, "--output_dir", str(tmp_path / "out")])
    assert str(e.value) == "[hf_rlhf] error: " + offline_line("reward model", RM)


def test_the_command_line_prints_one_line_and_exits_1(unreachable_hub, tmp_path):
    """The user's view: `hf-rlhf sft --model_name_or_path some-org/some-model` in a process of its own, with
    HF_HUB_OFFLINE unset (the fixture) and no network: exit 1, one error line, no traceback."""
    done = subprocess.run([sys.executable, "-m", "hf_rlhf.cli", "sft", "--model_name_or_path", MODEL,
                           "--toy_train_size", "8", "--toy_test_size", "4", "--output_dir", str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                          timeout=300)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, done.stderr
    assert_one_line(errors[0], "[hf_rlhf] error: " + unreachable_line("model", MODEL, unreachable_hub))
    assert done.stderr.rstrip().endswith(errors[0])
