"""The step watchdog's roll call at 16 and 64 simulated ranks against one real TCPStore
(tests/support/store_sim.py: real StepWatchdogs and Heartbeats, 64 per client process, a node of 8
ranks per host): what it costs each rank in store requests and bytes does not grow with the world
(the rank that opened the call alone reads every answer), a lost node is named and every survivor
exits with the requeue code, also when the node froze (the step timeout's verdict) while the
store stopped answering for longer than a store call may take. benchmarks/scale_store.py runs the
same at 64-1024 ranks, beside the roll call this one replaced."""

from __future__ import annotations

import pytest
from support.store_sim import Result, Scenario, simulate

from bigclip.train.preemption import REQUEUE_EXIT_CODE

pytestmark = [pytest.mark.dist, pytest.mark.slow]
SLACK_REQUESTS = 2  # a beat more or less in a roll call's window, as the threads are scheduled


def _assert_named_and_requeued(result: Result) -> None:
    s = result.scenario
    assert not result.missing, f"survivors that never exited: {result.missing}"
    assert result.codes == {REQUEUE_EXIT_CODE}, {e.rank: e.code for e in result.exits.values()}
    for e in result.exits.values():
        assert (e.silent, e.lost_nodes, e.store_error) == (s.lost_ranks, ["node1"], ""), e


def _split(result: Result) -> tuple[list, list]:
    """(the caller's exits, the others')."""
    callers = [e for e in result.exits.values() if e.report]
    return callers, [e for e in result.exits.values() if not e.report]


def test_a_roll_call_costs_each_rank_the_same_at_16_and_64_ranks() -> None:
    small, large = simulate(Scenario(world=16)), simulate(Scenario(world=64))
    for result in (small, large):
        _assert_named_and_requeued(result)
        callers, others = _split(result)
        assert len(callers) == 1, [e.rank for e in callers]  # one rank read every answer
        report = callers[0].report
        assert (
            "not answering (stopped, frozen, dead or its node lost): ranks [8, 9, 10, 11, 12, 13, 14, 15]"
            in report
        )
        assert "rank 8: SILENT, last seen after step 0 in " in report and "no rank on node1 answers" in report
    (caller16,), others16 = _split(small)
    (caller64,), others64 = _split(large)
    assert max(e.requests for e in others64) <= max(e.requests for e in others16) + SLACK_REQUESTS
    assert caller64.requests <= caller16.requests + SLACK_REQUESTS
    # bytes: the verdict (the silent node's beats) for every rank; the answers for the caller alone
    assert max(e.bytes_read for e in others64) <= max(e.bytes_read for e in others16) * 1.1
    assert caller64.bytes_read <= caller16.bytes_read * 64 / 16 * 1.2  # linear in the world
    # the whole store's work: linear in the ranks that answer (8 of 16, 56 of 64)
    per16, per64 = (sum(e.bytes_read for e in r.exits.values()) / len(r.exits) for r in (small, large))
    assert per64 <= per16 * 1.2, (per16, per64)


def test_a_frozen_node_is_named_within_the_step_timeout_though_the_store_stalls() -> None:
    """The lost node's process is SIGSTOPped (its ranks fall silent, their connections stay open)
    and the store's process too, for longer than a store call may take (its deadline, 10 s): the
    survivors' steps stop, their watchdogs time out, their first store calls are abandoned and
    made again on fresh connections, and the roll call still names the node."""
    result = simulate(Scenario(world=64, fault="stop", step_timeout_s=10, store_stop_s=12))
    _assert_named_and_requeued(result)
    slowest = max(e.seconds for e in result.exits.values())
    assert slowest < result.scenario.step_timeout_s + 30, slowest
    print(
        f"frozen node named and requeued {slowest:.1f} s after it froze (step timeout 10 s, store stopped 12 s)"
    )
