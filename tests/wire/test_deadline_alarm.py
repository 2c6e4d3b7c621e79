"""The sync deadline alarm: one shared thread, woken only for a deadline earlier than its own."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from agentkey.client._deadline import _ALARMS, Watchdog
from agentkey.client._effects import Outgoing
from agentkey.client._http import send_sync
from agentkey.client._protocol import Failure, FailureKind
from tests._loopback import raw_server


def _drip(conn: socket.socket, head: bytes) -> None:
    """Answer with a status line that never ends, one byte per 50 ms (2 minutes at most).

    Each read gets a byte well within any read timeout, so only the deadline alarm
    (which shuts the socket) can end such an answer before the test's timeout.
    """
    for _ in range(2400):
        conn.sendall(b"H")
        time.sleep(0.05)


@contextmanager
def other_request(seconds: float, *, ended: bool) -> Iterator[None]:
    """Another sync request's alarm, due in ``seconds``: in flight, or already ``ended``."""
    ours, theirs = socket.socketpair()
    dog = Watchdog(time.monotonic() + seconds, {})
    _ALARMS.arm(dog, ours)
    give_up = time.monotonic() + 10
    while _ALARMS._wake_at != dog.deadline and time.monotonic() < give_up:
        time.sleep(0.01)  # until the alarm thread sleeps until ``dog``'s deadline
    if ended:
        _ALARMS.disarm(dog)  # it sleeps on: disarming never wakes it
    try:
        yield
    finally:
        _ALARMS.disarm(dog)
        ours.close()
        theirs.close()


@pytest.mark.realtime  # a socket deadline: real time by nature
@pytest.mark.parametrize(
    ("seconds", "ended"),
    [(60.0, False), (0.5, True)],
    ids=["alarm-asleep-until-a-later-deadline", "alarm-asleep-until-an-ended-request"],
)
@pytest.mark.realtime  # real time: a socket deadline against a dripping peer
def test_dripping_headers_are_cut_at_the_deadline_whatever_the_alarm_sleeps_until(
    seconds: float, ended: bool
) -> None:
    """A header drip ends at its deadline, when the alarm thread slept for another request
    (left alone, the drip would outlast the test's timeout)."""
    with raw_server(_drip) as url, other_request(seconds, ended=ended), httpx.Client() as client:
        deadline = time.monotonic() + 1.0  # real time: the socket's deadline
        out = Outgoing("POST", url + "/x", (), b"{}", same_origin=True, deadline=deadline)
        reply = send_sync(client, out, auth=None, timeout=None)
    assert isinstance(reply, Failure)
    assert reply.kind is FailureKind.IN_DOUBT
    assert "deadline" in reply.description


def test_a_later_deadline_does_not_wake_the_alarm_thread() -> None:
    """Arming a request due after the alarm thread's next wake-up leaves that wake-up as it is."""
    with other_request(30.0, ended=False):
        wake_at = _ALARMS._wake_at
        assert wake_at < time.monotonic() + 31
        ours, theirs = socket.socketpair()
        dog = Watchdog(time.monotonic() + 60.0, {})
        try:
            _ALARMS.arm(dog, ours)
            assert _ALARMS._wake_at == wake_at
        finally:
            _ALARMS.disarm(dog)
            ours.close()
            theirs.close()
