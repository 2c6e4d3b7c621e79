"""The chaos suite: faults, kills and a Redis restart against the real client and server.

The quick profile (2,000 steps) runs by default; ``nox -s chaos`` runs the long one
(``AGENTKEY_CHAOS_STEPS=100000``). ``AGENTKEY_CHAOS_SEED`` replays a run's fault mix and
plans; ``AGENTKEY_CHAOS_REPORT`` names a file the summary is written to as JSON.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos._harness import Profile, run_chaos

PROFILE = Profile.from_env()


@pytest.mark.chaos
@pytest.mark.redis
@pytest.mark.timeout(PROFILE.budget + 120)
def test_every_step_runs_at_most_once_and_ends_typed_under_chaos(tmp_path: Path) -> None:
    """Under resets, lost answers, delays, 5xx, double sends, SIGKILLed agents, a Redis
    restart and short leases, no step runs twice, every call ends typed and in time."""
    summary = run_chaos(PROFILE, tmp_path)
    assert not summary["violations"], "\n".join(summary["violations"][:50])
    assert summary["steps"] >= PROFILE.steps
    assert summary["fault_rate"] >= 0.2
    assert summary["agent_kills"] == PROFILE.kills
    assert summary["redis_outage_seconds"] is not None
