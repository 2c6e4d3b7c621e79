"""The ``agentkey`` command: ``key``, ``demo``, ``serve``, ``check``, ``journal`` and ``server``
(docs/cli.md).

Exit codes, the same for every subcommand (docs/cli.md has the table): 0 success
(``check``: the server honours the contract; a listing, whatever it lists), 1 a
negative answer (``check``: a contract row failed; ``demo``: the contract broke;
``show``/``settle``: no such call or key), 2 a usage error (argparse's habit: a bad
option or value, a port in use, a missing extra, a journal or store that cannot be
opened), 3 no verdict or a refusal: ``check`` could not reach the target or the tool
refused the fresh request, ``serve`` could not reach ``--redis``, the journal refused
or failed. Every option is checked before anything is printed or started; options
such as ``--json`` and ``--journal`` go before or after their subcommand.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._exceptions import AgentKeyError, ConfigurationError, InsecureTransport
from ._keys import HEADER_STYLES
from ._plan import PlanSession
from ._version import __version__

if TYPE_CHECKING:
    from .client._checker import CheckReport, CheckResult

__all__ = ["main"]

EXIT_OK = 0
EXIT_FAILED = 1  # check: a contract row failed; demo: the contract broke
EXIT_USAGE = 2  # argparse's own code for usage errors
EXIT_UNREACHABLE = 3  # check: no verdict (target unreachable, fresh request refused);
# serve: --redis unreachable


def _step_index(text: str) -> tuple[int, ...]:
    try:
        parts = tuple(int(part) for part in text.split("."))
    except ValueError:
        parts = ()
    if not parts or min(parts) < 0:
        raise argparse.ArgumentTypeError(
            f"invalid step {text!r}: use an index such as 3, or 3.1 for a sub-step "
            "(whole numbers >= 0)"
        )
    return parts


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 0 to 65535, got {text!r}")
    return value


def _work_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be 0 to 3600 seconds, got {text!r}")
    return value


def _concurrency(text: str) -> int:
    from .client._checker import MAX_CONCURRENCY

    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 2 <= value <= MAX_CONCURRENCY:
        raise argparse.ArgumentTypeError(
            f"must be a whole number from 2 to {MAX_CONCURRENCY}, got {text!r}"
        )
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _cmd_key(ns: argparse.Namespace) -> int:
    args = _json_object(ns.args, "--args")
    if args is None:
        return EXIT_USAGE
    if ns.plan is not None and not ns.plan.strip():
        # An empty id would silently draw a new random plan on every run: a new key each time.
        print(
            "agentkey: --plan is empty; pass the plan session id, or leave --plan out for a "
            "new random one",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        plan = PlanSession.from_external_id(ns.plan) if ns.plan else PlanSession.new()
        step = plan.step(ns.step, ns.tool, args)
    except AgentKeyError as exc:  # an unusable --plan or --args value
        print(f"agentkey: --plan or --args: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(step.key.header_value(ns.style))
    return EXIT_OK


def _cmd_demo(ns: argparse.Namespace) -> int:
    from ._demo import run_demo  # imports the server half only when asked

    return run_demo()


def _missing_extra(command: str, exc: ImportError) -> int:
    print(
        f"agentkey: {command} needs the server extra ({exc.name or 'a package'} is missing): "
        "pip install 'agentkey-idempotency[server]'",
        file=sys.stderr,
    )
    return EXIT_USAGE


def _redis_problem(url: str) -> tuple[int, str] | None:
    """Why ``--redis`` cannot be used (exit code, message), or None once it answered PING."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
    except ValueError as exc:  # not a redis://, rediss:// or unix:// URL
        return EXIT_USAGE, f"--redis is not a Redis URL ({exc}); use redis://host:6379/0"
    try:
        client.ping()
    except redis.RedisError as exc:
        return EXIT_UNREACHABLE, f"--redis: no Redis answered ({type(exc).__name__}: {exc})"
    finally:
        client.close()
    return None


def _listen(host: str, port: int) -> socket.socket | str:
    """A socket bound and listening on ``host:port``, or why it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        why = exc.strerror or exc
        return f"cannot listen on {host}:{port} ({why}); choose another --port or --host"
    return sock


def _cmd_serve(ns: argparse.Namespace) -> int:
    try:
        import uvicorn

        from .server import MemoryStore, Store
        from .server._example import example_app

        if ns.redis:  # redis-py is needed only then: `agentkey serve` on memory runs without it
            from .server import RedisStore
    except ImportError as exc:
        return _missing_extra("serve", exc)
    if ns.redis:
        problem = _redis_problem(ns.redis)
        if problem is not None:
            print(f"agentkey: {problem[1]}", file=sys.stderr)
            return problem[0]
    sock = _listen(ns.host, ns.port)
    if isinstance(sock, str):
        print(f"agentkey: {sock}", file=sys.stderr)
        return EXIT_USAGE
    port = sock.getsockname()[1]  # --port 0: the free port just found
    sock.close()  # uvicorn binds it again at once (SO_REUSEADDR): the check is a fast fail
    store: Store = RedisStore(ns.redis) if ns.redis else MemoryStore()
    app = example_app(store, work_seconds=ns.work_seconds)
    where = "Redis" if ns.redis else "memory (lost on exit)"
    host = f"[{ns.host}]" if ":" in ns.host else ns.host
    print(
        f"agentkey example tool server on http://{host}:{port}: POST /tools/charge, "
        f"/tools/provision, /tools/report; GET /executions counts runs; records in {where}; "
        "send Authorization: Bearer <any token> (each token is its own caller; none: 401)",
        flush=True,
    )
    uvicorn.run(app, host=ns.host, port=port, log_level="warning")
    return EXIT_OK


_CHECK_WARNING = (
    "WARNING: this performs REAL side effects on the target. A correct server runs the "
    "tool 4 times (fresh call, concurrent burst, changed args, header styles); a broken "
    "one may run it more. Use a test instance or a harmless tool."
)


class _Repeated(ValueError):
    pass


def _unique(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise _Repeated(name)
            seen.add(name)
    return out


def _json_object(text: str, option: str) -> dict[str, object] | None:
    try:
        value = json.loads(text, object_pairs_hook=_unique)
    except _Repeated as exc:
        # Parsers disagree on which duplicate wins, so a server refuses such a body (400).
        print(f"agentkey: {option} repeats the member {str(exc)!r}; name it once", file=sys.stderr)
        return None
    except json.JSONDecodeError as exc:
        print(f"agentkey: {option} is not valid JSON: {exc}", file=sys.stderr)
        return None
    if not isinstance(value, dict):
        print(f"agentkey: {option} must be a JSON object", file=sys.stderr)
        return None
    return value


def _remember_days(text: str) -> float:
    """``--remember-days``: more than 0, at most a year (checked before any request)."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= 365:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 365, got {text!r}")
    return value


def _cmd_check(ns: argparse.Namespace) -> int:
    from ._canonical import canonical_json
    from .client._checker import check_options, check_server  # the checker loads only when used

    args = _json_object(ns.args, "--args")
    changed = None if ns.changed_args is None else _json_object(ns.changed_args, "--changed-args")
    if args is None or (ns.changed_args is not None and changed is None):
        return EXIT_USAGE
    option = "--args"
    try:  # before the warning: a value no tool can be sent (NaN) is a usage error
        plain = canonical_json(args)
        option = "--changed-args"
        other = None if changed is None else canonical_json(changed)
    except AgentKeyError as exc:
        print(f"agentkey: {option}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if other == plain:
        print("agentkey: --changed-args must differ from --args", file=sys.stderr)
        return EXIT_USAGE
    token = ns.token if ns.token is not None else os.environ.get("AGENTKEY_CHECK_TOKEN")
    try:  # every option checked before the warning, and before any request
        check_options(
            ns.url, path=ns.path, token=token or None, style=ns.style, other_path=ns.other_path
        )
    except (ConfigurationError, InsecureTransport) as exc:
        print(f"agentkey: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(_CHECK_WARNING, file=sys.stderr)
    progress = _progress if sys.stderr.isatty() else None
    try:
        report = check_server(
            ns.url,
            path=ns.path,
            args=args,
            changed_args=changed,
            token=token or None,
            style=ns.style,
            concurrency=ns.concurrency,
            timeout=ns.timeout,
            other_path=ns.other_path,
            progress=progress,
        )
    except (ConfigurationError, InsecureTransport) as exc:
        print(f"agentkey: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(_report_json(report), indent=2) if ns.json else report.table())
    if ns.remember:  # a pass becomes the route's evidence in the journal (docs/journal.md)
        from .client._remember import remember_from_cli

        try:
            remember_from_cli(
                report, ns.url, ns.path, ns.remember_days, getattr(ns, "journal", None)
            )
        except AgentKeyError as exc:
            print(f"agentkey: --remember: {exc}", file=sys.stderr)
            return EXIT_USAGE
    if report.unreachable is not None or report.no_verdict is not None:
        return EXIT_UNREACHABLE
    return EXIT_OK if report.ok else EXIT_FAILED


def _progress(row: CheckResult) -> None:
    """A row as soon as it is decided, on the terminal (stderr): the check takes seconds."""
    print(f"  {row.verdict:<6}  {row.scope:<8}  {row.name}", file=sys.stderr, flush=True)


def _report_json(report: CheckReport) -> dict[str, object]:
    """``check --json``: the schema docs/cli.md documents (schema 1)."""
    if report.unreachable is not None or report.no_verdict is not None:
        outcome = "no_verdict"
    else:
        outcome = "honours" if report.ok else "does_not_honour"
    verdicts = ("PASS", "FAIL", "WARN", "SKIP")
    return {
        "schema": 1,
        "target": report.target,
        "style": report.style,
        "outcome": outcome,
        "ok": report.ok,
        "unreachable": report.unreachable,
        "no_verdict": report.no_verdict,
        "counts": {v: sum(r.verdict == v for r in report.results) for v in verdicts},
        "results": [
            {
                "name": r.name,
                "verdict": r.verdict,
                "scope": r.scope,
                "detail": r.detail,
                "evidence": list(r.evidence),
            }
            for r in report.results
        ],
    }


_DEMO_DESCRIPTION = """\
Runs a four-step agent plan against agentkey's example tool server, in this
process (no network, no Redis, nothing to set up), and shows what the
Idempotency-Key does:

  1. a charge whose answer is lost after the server committed: the invoker
     resends the same key and gets the stored answer, so the card is charged once;
  2. two workers racing the same step: one runs it, the other gets 409 and then
     the replay;
  3. the orchestrator restarts and restores the plan: the same step with the same
     arguments (in another order) has the same key and is replayed;
  4. the planner changes an argument: a new key, so a new operation.

It ends with the side effects counted on the server and exits 0 if the
contract held, 1 if it did not."""

_CHECK_EPILOG = """\
exit status: 0 the server honours the contract (agentkey-specific rows may
still fail: they are reported, not required); 1 a contract row failed; 2 a
usage error; 3 the target could not be reached (down, DNS, TLS), the tool
refused the fresh request, or the transport failed mid-check: no verdict. On a terminal each row
is printed to stderr as soon as it is decided."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentkey",
        description="Deterministic idempotency keys for the tool calls of AI agents.",
    )
    parser.add_argument("--version", action="version", version=f"agentkey {__version__}")
    # --json goes before or after the subcommand; no level sets a default (a subcommand's
    # would overwrite what came before it): main() does.
    parser.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="JSON output, for check, journal and server (also after the subcommand)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    key = sub.add_parser(
        "key",
        help="print the Idempotency-Key of one step",
        description="Print the Idempotency-Key agentkey sends for one step of a plan: "
        "<plan>:step_<index>:<sha256 of the canonical JSON args>. Use it to compute, "
        "from a shell or another language, the key a server will see.",
    )
    key.add_argument(
        "--plan",
        help="plan session id (default: a new random one); a framework's own id such as a "
        "LangGraph thread_id is used as is when it fits [A-Za-z0-9._~-]{1,64}",
    )
    key.add_argument("--step", type=_step_index, required=True, help="step index, e.g. 3 or 3.1")
    key.add_argument("--tool", default="tool", help="tool name (not part of the key)")
    key.add_argument("--args", required=True, help="the arguments as a JSON object")
    key.add_argument(
        "--style",
        choices=HEADER_STYLES,
        default="raw",
        help="header value style: raw (the default, as Stripe and most servers expect), "
        "sf-string (an RFC 8941 quoted string, as the IETF draft specifies) or uuid (a UUIDv5 "
        "of the key, for servers that accept only UUIDs)",
    )
    key.set_defaults(func=_cmd_key)

    demo = sub.add_parser(
        "demo",
        help="run a plan against an in-process tool server: lost answers, races, restarts, "
        "replans (no outside services)",
        description=_DEMO_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.set_defaults(func=_cmd_demo)

    serve = sub.add_parser(
        "serve",
        help="serve the example tool server (behind agentkey's middleware) on a port",
        description="Serve agentkey's example tool server, the one the demo and the docs use, "
        "so an agent, `agentkey check` or curl can call it. Tools: POST /tools/charge "
        '{"amount": <positive int>, "currency": "EUR"}; POST /tools/provision {"region": "..."} '
        '(works a moment before its side effect); POST /tools/report {"rows": 0..20000}; '
        "GET /executions returns how often each tool really ran. Every tool needs an "
        "Idempotency-Key header.",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address (default: loopback)")
    serve.add_argument(
        "--port", type=_port, default=8000, help="port to listen on (default 8000; 0: any free one)"
    )
    serve.add_argument(
        "--redis",
        metavar="URL",
        help="keep records in this Redis (redis://host:6379/0) instead of in memory",
    )
    serve.add_argument(
        "--work-seconds",
        type=_work_seconds,
        default=0.2,
        help="how long provision works before its side effect (default 0.2)",
    )
    serve.set_defaults(func=_cmd_serve)

    check = sub.add_parser(
        "check",
        help="check that a tool server honours the idempotency contract (real side effects!)",
        description="Check each point of the idempotency contract against a live tool server "
        "and print a pass/fail table. Rows marked 'contract' are the IETF Idempotency-Key "
        "draft's rules, which any server should follow; rows marked 'agentkey' are what "
        "agentkey's own server adds. " + _CHECK_WARNING,
        epilog=_CHECK_EPILOG,
    )
    check.add_argument(
        "url",
        help="base URL of the tool server, e.g. https://tools.example.com (no user:password@)",
    )
    check.add_argument("--path", required=True, help="the tool's path, e.g. /tools/provision")
    check.add_argument("--args", required=True, help="valid tool arguments as a JSON object")
    check.add_argument(
        "--changed-args",
        help="a different valid argument object (default: --args plus a nonce field)",
    )
    check.add_argument(
        "--other-path",
        help="another route the same key is sent to, which must not replay the first route's "
        "answer (default: --path plus '/agentkey-check-other-route', which no tool serves; "
        "name another tool's route if the server routes every sub-path to a tool)",
    )
    check.add_argument(
        "--token",
        help="bearer token (never printed; default: $AGENTKEY_CHECK_TOKEN, which keeps it "
        "out of the process list)",
    )
    check.add_argument(
        "--style",
        choices=HEADER_STYLES,
        default="raw",
        help="key header style of the main requests: raw (the default, as Stripe sends it), "
        "sf-string (RFC 8941 quoted, as the IETF draft specifies; the other of the two is "
        "checked once as well) or uuid (a UUIDv5 of the key, for servers that accept only "
        "UUIDs)",
    )
    check.add_argument(
        "--concurrency",
        type=_concurrency,
        default=8,
        help="how many identical requests are sent at once to prove a concurrent duplicate "
        "does not run the tool twice (2 to 64, default 8)",
    )
    check.add_argument(
        "--timeout", type=_seconds, default=30.0, help="seconds per request (default 30)"
    )
    check.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print the report as one JSON object (schema in docs/cli.md) instead of the table",
    )
    check.add_argument(
        "--remember",
        action="store_true",
        help="when the check passes, write it into the journal as evidence that this route "
        "honours keys, so invokers resend a call that may have run there (a failed check "
        "writes nothing)",
    )
    check.add_argument(
        "--remember-days",
        type=_remember_days,
        default=7.0,
        metavar="DAYS",
        help="how long a remembered pass counts (default 7, at most 365)",
    )
    check.set_defaults(func=_cmd_check)

    from ._journal_cli import add_parser as add_journal_parser

    add_journal_parser(sub)
    server = sub.add_parser(
        "server",
        add_help=False,
        help="list and settle the keys in doubt in a server's idempotency store "
        "(agentkey server doubt|settle --help)",
    )
    server.add_argument("args", nargs=argparse.REMAINDER)
    server.set_defaults(func=_cmd_server)
    return parser


def _cmd_server(ns: argparse.Namespace) -> int:
    """``agentkey server ...``: parsed by the server half, which loads only when asked."""
    try:
        from .server._cli import main as server_main
    except ImportError as exc:
        return _missing_extra("server", exc)
    return server_main(["--json", *ns.args] if getattr(ns, "json", False) else ns.args)


#: The subcommands that print JSON with --json.
_JSON_COMMANDS = ("check", "journal", "server")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["server"]:  # its own parser, in the server half (its --help too)
        return _cmd_server(argparse.Namespace(args=args[1:]))
    parser = _parser()
    ns = parser.parse_args(args)
    if getattr(ns, "json", False) and ns.command not in _JSON_COMMANDS:
        parser.error(f"--json applies to {', '.join(_JSON_COMMANDS)}, not to {ns.command}")
    if ns.command == "check":
        ns.json = getattr(ns, "json", False)
    try:
        code: int = ns.func(ns)
    except AgentKeyError as exc:
        print(f"agentkey: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
