"""What one invoker remembers about its routes: shown to honour keys, or asked and not.

The journal keeps positive evidence for every process (``Journal.learn``); this
memory sits in front of it, per invoker (and per MCP session), so a route is
asked with ``OPTIONS`` once, not once per call. Both answers are kept for a
bounded time on the flow's own clock (``ttl`` seconds): a route that was asked
and said nothing is not asked again before then, and evidence forgotten by an
operator (``agentkey journal evidence --forget``) stops counting here by then.
Nothing here does I/O or reads a clock; the dict is bounded (oldest entries go
first). Each method makes single dict operations, so threads sharing an invoker at
worst ask a route twice.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["NEGATIVE_TTL", "RouteMemory"]

#: How long an answer (either kind) is trusted in memory: ten minutes.
NEGATIVE_TTL = 600.0
_MAX_ROUTES = 1024


class RouteMemory:
    """``route -> (evidence or None, until)`` for one invoker; bounded."""

    __slots__ = ("_routes", "ttl")

    def __init__(self, ttl: float = NEGATIVE_TTL) -> None:
        self.ttl = ttl
        self._routes: OrderedDict[str, tuple[str | None, float]] = OrderedDict()

    def __repr__(self) -> str:
        return f"RouteMemory({len(self._routes)} routes)"

    def get(self, route: str, now: float) -> tuple[bool, str | None]:
        """``(known, evidence)``: whether ``route`` was asked or shown lately, and how."""
        found = self._routes.get(route)
        if found is None:
            return False, None
        if now >= found[1]:
            self._routes.pop(route, None)
            return False, None
        return True, found[0]

    def put(self, route: str, evidence: str | None, now: float) -> None:
        """Remember what ``route`` showed (None: asked, and it showed nothing)."""
        self._routes.pop(route, None)
        self._routes[route] = (evidence, now + self.ttl)
        for old in list(self._routes)[: max(0, len(self._routes) - _MAX_ROUTES)]:
            self._routes.pop(old, None)  # the oldest first (another thread may beat us)
