"""bench/reward_server_load.py: 32 clients against the reference reward server for a few seconds; every row of every
answer is the row sent (none lost, duplicated or mixed) and no request fails (socketserver's listen backlog of 5
reset connections at this concurrency). Latency and throughput are printed, not asserted."""

import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def load_bench():
    sys.path.insert(0, str(BENCH))
    try:
        import reward_server_load

        yield reward_server_load
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop("reward_server_load", None)


def test_32_clients_get_every_row_scored_once_and_no_request_fails(load_bench):
    result = load_bench.measure(clients=32, seconds=3.0, batch=16)
    assert result["requests"] > 100 and result["rows_checked"] == 16 * result["requests"]
    assert result["lost"] == result["duplicated"] == result["mixed_answers"] == 0
    assert result["errors"] == 0, result["first_errors"]
    assert result["server_after"]["threads"] <= result["server_before"]["threads"]  # handler threads ended
