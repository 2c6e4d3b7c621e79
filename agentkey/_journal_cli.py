"""``agentkey journal``: what the client's journal says about the calls an agent sent.

```
agentkey journal list [--plan P] [--state S] [--journal PATH|redis://...|postgresql://...]
agentkey journal doubt                     every call that may have run, unsettled
agentkey journal show KEY                  one call (KEY as printed: plan:step:#digest)
agentkey journal settle KEY --ran|--not-run [--reason TEXT] [--force]
agentkey journal prune --older-than SECONDS [--include-unsettled]
agentkey journal evidence [--forget ROUTE]  what routes showed about honouring keys
```

Keys are printed as digests (``plan:step_003:#1a2b3c4d``, never the whole key,
which is a bearer secret); every command that takes a key takes that form.
``--json`` prints JSON lines for scripts (times as Unix seconds; the text output
prints them as ISO 8601 UTC). ``--journal`` and ``--json`` go before or after the
subcommand. The command never creates a journal: a path with no journal at it is an
error naming the path (exit 2).

Exit codes: 0 done (a listing exits 0 whatever it lists, nothing included); 1 the
call or route named is not there (``show``/``settle`` KEY, ``evidence --forget``);
2 a usage error or a journal that cannot be opened; 3 the journal refused (a settle
of a call whose sender is alive, or that already ended, without ``--force``) or
failed (unreachable).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ._clock import SYSTEM
from ._exceptions import AgentKeyError, ConfigurationError, JournalError
from ._keys import shown_key
from .client._net import redact_url
from .journal._base import CallRecord, CallState, Evidence, Journal, is_live, route_of
from .journal._default import ENV

__all__ = ["add_parser"]

EXIT_OK, EXIT_FOUND_NOTHING, EXIT_USAGE, EXIT_REFUSED = 0, 1, 2, 3
_STATES = [s.value for s in CallState]


def add_parser(sub: Any) -> None:
    """Add ``journal`` and its sub-commands to the ``agentkey`` parser's sub-parsers."""
    # --journal and --json are accepted before or after the subcommand: each level has them,
    # and none sets a default (a subcommand's default would overwrite what came before it);
    # _run fills in the defaults.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--journal",
        metavar="WHERE",
        default=argparse.SUPPRESS,
        help=f"the journal: a SQLite file, redis://... or postgresql://... (default: "
        f"${ENV}, else the file in your data directory)",
    )
    common.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print JSON lines for scripts (times as Unix seconds)",
    )
    journal = sub.add_parser(
        "journal",
        parents=[common],
        help="list, show and settle the calls in the client's journal",
        description="The client's journal records every call before it is sent and how it "
        "ended: answered, failed, accepted (still running on the tool), not sent, or in "
        "doubt (it may have run, and nothing says whether it did). A call in doubt to a tool "
        "that does not honour Idempotency-Key is never sent again blindly: find out whether "
        "it ran, then settle it here. Keys are printed as digests, never whole.",
    )
    commands = journal.add_subparsers(dest="journal_command", required=True)

    listing = commands.add_parser(
        "list", parents=[common], help="the latest calls, newest first (exit 0)"
    )
    listing.add_argument("--plan", help="only this plan session's calls")
    listing.add_argument("--state", choices=_STATES, action="append", help="only these states")
    listing.add_argument("--limit", type=_count, default=50, help="at most this many (50)")
    listing.set_defaults(func_command=_list)

    doubt = commands.add_parser(
        "doubt",
        parents=[common],
        help="every call that may have run, unsettled (exit 0, also when there is none)",
    )
    doubt.add_argument("--plan", help="only this plan session's calls")
    doubt.add_argument("--limit", type=_count, default=500, help="at most this many (500)")
    doubt.set_defaults(func_command=_doubt)

    show = commands.add_parser(
        "show", parents=[common], help="one call in full (exit 1: no such call)"
    )
    show.add_argument("key", help="the call's key as printed (plan:step_003:#1a2b3c4d)")
    show.add_argument("--body", action="store_true", help="print the kept answer too")
    show.set_defaults(func_command=_show)

    settle = commands.add_parser(
        "settle",
        parents=[common],
        help="record your verdict on a call in doubt",
        description="Record whether a call in doubt ran. --ran: it did (a later call of the "
        "same step is answered from the journal, or refused if no answer was kept, and never "
        "sent again to a tool that does not honour keys); --not-run: it did not, and cannot "
        "still arrive (the next call of the same step sends it).",
    )
    settle.add_argument("key", help="the call's key as printed (plan:step_003:#1a2b3c4d)")
    verdict = settle.add_mutually_exclusive_group(required=True)
    verdict.add_argument("--ran", action="store_true", help="the call ran")
    verdict.add_argument("--not-run", action="store_true", help="the call did not run")
    settle.add_argument("--reason", default="", help="why you know (kept in the journal)")
    settle.add_argument(
        "--force",
        action="store_true",
        help="overwrite a call that already ended (answered, failed, ...); a call whose "
        "sender is alive is refused even so",
    )
    settle.set_defaults(func_command=_settle)

    prune = commands.add_parser(
        "prune",
        parents=[common],
        help="delete records of ended calls untouched for a while",
        description="Delete the records of ended calls (answered, accepted, failed, not "
        "sent) untouched for --older-than seconds. A call that may have run and is not "
        "settled (pending, in doubt) is kept: it is what stops the step being sent again.",
    )
    prune.add_argument("--older-than", type=_seconds, required=True, metavar="SECONDS")
    prune.add_argument(
        "--include-unsettled",
        action="store_true",
        help="also delete calls in doubt (and pending ones whose sender is gone); the next "
        "call of such a step is sent again",
    )
    prune.set_defaults(func_command=_prune)

    evidence = commands.add_parser(
        "evidence",
        parents=[common],
        help="what routes showed about honouring Idempotency-Key",
        description="Each route (method and URL) that showed it honours Idempotency-Key: "
        "how (a protection header, a replay marker, a key problem answer), when first and "
        "last seen, and when it expires (30 days after it was last seen). A call that may "
        "have run is resent only to such a route. --forget ROUTE drops one.",
    )
    evidence.add_argument(
        "--forget", metavar="ROUTE", help="forget this route's evidence ('POST https://...')"
    )
    evidence.set_defaults(func_command=_evidence)
    journal.set_defaults(func=_run)


def _count(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 100_000:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to 100000, got {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 60 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 60, got {text!r}")
    return value


def _run(ns: argparse.Namespace) -> int:
    where = getattr(ns, "journal", None)
    ns.json = getattr(ns, "json", False)
    try:
        journal = _open(where)
    except AgentKeyError as exc:
        said = str(exc)
        if "--journal" not in said:  # say which option to fix, not only what went wrong
            said += f" (check --journal, or ${ENV})"
        print(f"agentkey: {said}", file=sys.stderr)
        return EXIT_USAGE
    # A record the journal cannot read is skipped with a warning: show it on stderr.
    logger = logging.getLogger("agentkey")
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        code: int = ns.func_command(ns, journal)
    except JournalError as exc:
        if exc.idempotency_key is not None:  # a refusal about one call: it says what to do
            print(f"agentkey: {exc}", file=sys.stderr)
        else:  # the journal itself failed; its own advice is for Python callers
            print(_unusable(where, str(exc).partition(";")[0]), file=sys.stderr)
        return EXIT_REFUSED
    except _backend_errors() as exc:
        print(_unusable(where, f"the journal failed ({type(exc).__name__})"), file=sys.stderr)
        return EXIT_REFUSED
    finally:
        logger.removeHandler(handler)
        journal.close()
    return code


def _iso_utc(seconds: float) -> str:
    """Unix seconds as ISO 8601 UTC to the second: ``2026-12-06T11:31:02Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _unusable(where: str | None, what: str) -> str:
    named = f"--journal {_where(where)}" if where else f"${ENV} or the default journal"
    return (
        f"agentkey: {what}, so nothing was read or changed; check that {named} names a "
        "journal that is reachable (pass --journal to name another)"
    )


def _where(where: str) -> str:
    return redact_url(where) if "://" in where else repr(where)


def _backend_errors() -> tuple[type[Exception], ...]:
    """What a journal's database driver raises when it cannot be reached."""
    errors: list[type[Exception]] = [OSError]
    try:
        from redis import RedisError

        errors.append(RedisError)
    except ImportError:  # pragma: no cover - the redis extra is not installed
        pass
    try:
        import psycopg

        errors.append(psycopg.Error)
    except ImportError:  # pragma: no cover - the postgres extra is not installed
        pass
    return tuple(errors)


def _open(where: str | None) -> Any:
    """The journal named by ``--journal``, else ``$AGENTKEY_JOURNAL``, else the default file.

    A SQLite journal is opened with ``create=False``: nothing is created, and a path with no
    journal at it is an error naming it."""
    from .journal._sqlite import SQLiteJournal

    if where is None:
        setting = os.environ.get(ENV, "").strip()
        if setting.lower() in ("off", "none", "false", "0"):
            raise ConfigurationError(f"${ENV} turns the journal off; pass --journal")
        if setting.lower() == "memory":
            raise ConfigurationError(
                f"${ENV}=memory keeps each process's journal in its memory, where this "
                "command cannot see it; pass --journal"
            )
        if not setting:
            return SQLiteJournal(create=False)
        where = setting
    if where.startswith(("redis://", "rediss://", "unix://")):
        import redis

        from .journal._redis import RedisJournal

        try:  # the URL is read when the journal is first used: check it now
            redis.Redis.from_url(where).close()
        except ValueError as exc:
            raise ConfigurationError(
                f"--journal is not a Redis URL ({exc}); use redis://host:6379/0"
            ) from None
        return RedisJournal(where)
    if where.startswith(("postgresql://", "postgres://")):
        from .journal._postgres import PostgresJournal

        return PostgresJournal(where)
    return SQLiteJournal(where, create=False)


def _find(journal: Journal, shown: str) -> CallRecord | None:
    """The record a printed key names: ``plan:step:#digest`` (or the whole key)."""
    plan, _, rest = shown.partition(":")
    if not rest:
        return None
    exact = journal.get(shown) if not shown.count("#") else None
    if exact is not None:
        return exact
    matches = [r for r in journal.find(plan) if shown_key(r.key) == shown]
    return matches[0] if len(matches) == 1 else None


def _row(record: CallRecord, now: float) -> dict[str, Any]:
    state = record.state.value
    if record.state is CallState.PENDING and not is_live(record, now):
        state = "in_doubt"  # its sender is gone
    return {
        "key": shown_key(record.key),
        "plan": record.plan,
        "step": record.step,
        "tool": record.tool,
        "state": state,
        "status": record.status_code,
        "attempts": record.attempts,
        "source": record.source,
        "updated": record.updated_at,
        "route": _route(record.route),
        "reason": record.reason,
        "error": record.error,
        "call_id": record.call_id,
    }


def _route(route: str) -> str:
    method, _, url = route.partition(" ")
    return f"{method} {redact_url(url)}"


def _print(rows: Sequence[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        for row in rows:
            print(json.dumps(row, sort_keys=True))
        return
    if not rows:
        print("no calls")
        return
    header = ("UPDATED", "STATE", "STEP", "TOOL", "STATUS", "KEY", "REASON")
    lines = [header] + [
        (
            _iso_utc(row["updated"]),
            row["state"],
            row["step"] or "",
            row["tool"] or "",
            "" if row["status"] is None else str(row["status"]),
            row["key"],
            _clean(row["reason"] or row["error"] or ""),
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        )


def _clean(text: str, limit: int = 60) -> str:
    flat = "".join(ch if ch.isprintable() else " " for ch in text)
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _list(ns: argparse.Namespace, journal: Any) -> int:
    states = [CallState(s) for s in ns.state] if ns.state else None
    now = SYSTEM.time()
    rows = [_row(r, now) for r in journal.calls(plan=ns.plan, states=states, limit=ns.limit)]
    _print(rows, ns.json)
    return EXIT_OK


def _doubt(ns: argparse.Namespace, journal: Any) -> int:
    now = SYSTEM.time()
    found = journal.calls(
        plan=ns.plan, states=[CallState.IN_DOUBT, CallState.PENDING], limit=ns.limit
    )
    rows = [_row(r, now) for r in found if not is_live(r, now)]
    _print(rows, ns.json)
    return EXIT_OK  # a listing, like list: nothing in doubt is no error


def _show(ns: argparse.Namespace, journal: Any) -> int:
    record = _find(journal, ns.key)
    if record is None:
        print(f"agentkey: no call {ns.key!r} in the journal", file=sys.stderr)
        return EXIT_FOUND_NOTHING
    row = _row(record, SYSTEM.time())
    row["created"] = record.created_at
    row["body_size"] = record.body_size
    row["status_url"] = redact_url(record.status_url) if record.status_url else None
    if ns.body and record.body is not None:
        row["body"] = record.body.decode("utf-8", "replace")
    if ns.json:  # times as Unix seconds, for scripts
        print(json.dumps(row, sort_keys=True))
    else:
        for name, value in row.items():
            if name in ("updated", "created"):
                value = _iso_utc(value)
            if value is not None:
                print(f"{name:>10}  {_clean(str(value), 2000) if name != 'body' else value}")
    return EXIT_OK


def _settle(ns: argparse.Namespace, journal: Any) -> int:
    record = _find(journal, ns.key)
    if record is None:
        print(f"agentkey: no call {ns.key!r} in the journal", file=sys.stderr)
        return EXIT_FOUND_NOTHING
    state = CallState.ANSWERED if ns.ran else CallState.NOT_SENT
    verdict = "ran" if ns.ran else "did not run"
    reason = f"settled by an operator: {verdict}" + (f" ({ns.reason})" if ns.reason else "")
    settled = journal.settle(record.key, state, reason=reason, force=ns.force)
    if settled is None:
        print(f"agentkey: no call {ns.key!r} in the journal", file=sys.stderr)
        return EXIT_FOUND_NOTHING
    _print([_row(settled, SYSTEM.time())], ns.json)
    return EXIT_OK


def _prune(ns: argparse.Namespace, journal: Any) -> int:
    count = journal.prune(older_than=ns.older_than, include_unsettled=ns.include_unsettled)
    print(json.dumps({"deleted": count}) if ns.json else f"deleted {count} record(s)")
    return EXIT_OK


def _evidence_row(found: Evidence) -> dict[str, Any]:
    row = found.to_dict()
    row["route"] = _route(found.route)
    return row


def _evidence(ns: argparse.Namespace, journal: Any) -> int:
    if ns.forget is not None:
        route = _normal_route(ns.forget)
        if route is None:
            print(
                "agentkey: --forget takes a route as listed, 'METHOD URL' (POST "
                f"https://host/path), got {_clean(ns.forget)!r}",
                file=sys.stderr,
            )
            return EXIT_USAGE
        forgot = journal.forget(route)
        if ns.json:
            print(json.dumps({"route": _route(route), "forgotten": forgot}))
        else:
            print(f"forgot {_route(route)}" if forgot else f"no evidence for {_route(route)}")
        return EXIT_OK if forgot else EXIT_FOUND_NOTHING
    rows = [_evidence_row(e) for e in journal.evidence()]  # a listing: exit 0, none included
    if ns.json:
        for row in rows:
            print(json.dumps(row, sort_keys=True))
    elif not rows:
        print("no evidence")
    else:
        lines = [("LAST SEEN", "EXPIRES", "MARKER", "ROUTE")] + [
            (
                _iso_utc(row["last_seen"]),
                _iso_utc(row["expires_at"]),
                _clean(row["marker"], 40),
                _clean(row["route"], 200),
            )
            for row in rows
        ]
        widths = [max(len(line[i]) for line in lines) for i in range(4)]
        for line in lines:
            print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
    return EXIT_OK


def _normal_route(text: str) -> str | None:
    """``METHOD URL`` as the journal keys it (the method upper-cased, no query); None when
    ``text`` is not a route."""
    method, _, url = text.strip().partition(" ")
    if not method.isalpha() or "://" not in url:
        return None
    return route_of(method, url.strip())
