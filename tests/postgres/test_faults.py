"""Issue 30 on a real PostgreSQL: restarts, killed connections, a locked table, a stopped
postmaster, under racing load, with a plain tool and a transactional tool.

The run itself is ``tests/postgres/_faults.py`` (also a script, to compare two versions
of agentkey on the same harness). Each fault is inflicted twice; about a minute.
"""

from __future__ import annotations

import pytest

from tests._postgres import postgres_cluster
from tests.postgres._faults import RECOVERY, STALL, run


@pytest.mark.long
@pytest.mark.realtime
@pytest.mark.timeout(600)
def test_database_faults_cost_a_second_not_a_lease() -> None:
    """0 duplicates and orphans, no 503 later than 1 s after the database answers again, no
    key left blocked, no 500, no request held by a lock, every step answered alike."""
    with postgres_cluster(durable=True) as cluster:  # acknowledged commits survive a crash
        report = run(cluster, reps=2)
    print(report.as_json())
    assert report.steps > 200
    assert report.duplicates == 0
    assert report.orphans == 0
    assert report.never_run == 0
    assert report.answered_differently == 0
    assert report.hangs == 0
    assert report.tracebacks == 0
    assert report.server_errors == 0, report.statuses
    assert set(report.statuses) <= {"201", "409", "503"}, report.statuses  # no timeouts either
    assert report.late_503s == 0, (f"503s later than {RECOVERY} s after recovery", report.faults)
    assert report.stalled == 0, f"steps unanswered {STALL} s after recovery"
    for fault in report.faults:
        if fault["kind"] == "lock":  # held 6 s; a request waits lock_timeout (1 s) per try
            assert fault["longest_request_s"] < 4.0, fault
