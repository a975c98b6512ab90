"""The model zoo: every guarantee of hf_rlhf, checked on tiny random-init models of each architecture.

Tests here take a `model_type` parameter (see `zoo_models.MODEL_TYPES`). A test that expects hf_rlhf to refuse an
architecture records the refusal's message with `record_property("refusal", message)`. With
`--zoo-results PATH`, every test's outcome (pass / refusal / fail / skip, with its message) is written to PATH as
JSON, which `tests/zoo/make_table.py` turns into the architectures x guarantees table of docs/architectures.md.
"""

import json
import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--zoo-results", default=None, help="write the zoo's outcomes to this JSON file")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every zoo test on one torch thread (tests/conftest.py)."""


@pytest.fixture(autouse=True)
def _deterministic_seed():
    import torch

    torch.manual_seed(0)


_OUTCOMES: dict[str, dict] = {}


def pytest_itemcollected(item):
    """Each zoo test's function name and parameters travel with its reports (for the results file)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    item.user_properties.append(("test", item.originalname))
    item.user_properties.append(("params", {k: str(v) for k, v in params.items()}))


def pytest_runtest_logreport(report):
    if "tests/zoo/" not in report.nodeid.replace(os.sep, "/"):
        return
    if report.when == "call" or report.outcome != "passed":  # setup/teardown count only when they did not pass
        props = dict(report.user_properties)
        entry = _OUTCOMES.setdefault(report.nodeid, {"test": props.get("test"), "params": props.get("params", {}),
                                                     "outcome": "passed", "message": None})
        if report.outcome == "failed":
            crash = report.longrepr.reprcrash.message if hasattr(report.longrepr, "reprcrash") else report.longrepr
            entry.update(outcome="failed", message=str(crash))
        elif report.outcome == "skipped":
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            entry.update(outcome="skipped", message=reason.removeprefix("Skipped: "))
        elif "refusal" in props:
            entry.update(outcome="refused", message=props["refusal"])
        entry["duration"] = entry.get("duration", 0.0) + report.duration


def pytest_sessionfinish(session):
    path = session.config.getoption("--zoo-results")
    if path:
        with open(path, "w") as f:
            json.dump(_OUTCOMES, f, indent=1)  # in run order
