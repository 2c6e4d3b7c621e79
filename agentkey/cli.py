"""The ``agentkey`` command: ``key``, ``demo`` and ``check``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from ._exceptions import AgentKeyError
from ._plan import PlanSession
from ._version import __version__

__all__ = ["main"]


def _step_index(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split("."))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid step {text!r}: use an index such as 3, or 3.1 for a sub-step"
        ) from None


def _cmd_key(ns: argparse.Namespace) -> int:
    try:
        args = json.loads(ns.args)
    except json.JSONDecodeError as exc:
        print(f"agentkey: --args is not valid JSON: {exc}", file=sys.stderr)
        return 2
    plan = PlanSession.from_external_id(ns.plan) if ns.plan else PlanSession.new()
    step = plan.step(ns.step, ns.tool, args)
    print(step.key.header_value(ns.style))
    return 0


def _cmd_demo(ns: argparse.Namespace) -> int:
    from ._demo import run_demo  # imports the server half only when asked

    return run_demo()


_CHECK_WARNING = (
    "WARNING: this performs REAL side effects on the target. A correct server runs the "
    "tool 4 times (fresh call, concurrent burst, changed args, header styles); a broken "
    "one may run it more. Use a test instance or a harmless tool."
)


def _json_object(text: str, option: str) -> dict[str, object] | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        print(f"agentkey: {option} is not valid JSON: {exc}", file=sys.stderr)
        return None
    if not isinstance(value, dict):
        print(f"agentkey: {option} must be a JSON object", file=sys.stderr)
        return None
    return value


def _cmd_check(ns: argparse.Namespace) -> int:
    from ._checker import check_server  # the checker loads only when used

    args = _json_object(ns.args, "--args")
    changed = None if ns.changed_args is None else _json_object(ns.changed_args, "--changed-args")
    if args is None or (ns.changed_args is not None and changed is None):
        return 2
    token = ns.token if ns.token is not None else os.environ.get("AGENTKEY_CHECK_TOKEN")
    print(_CHECK_WARNING, file=sys.stderr)
    report = check_server(
        ns.url,
        path=ns.path,
        args=args,
        changed_args=changed,
        token=token or None,
        style=ns.style,
        concurrency=ns.concurrency,
        timeout=ns.timeout,
    )
    print(report.table())
    return 0 if report.ok else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentkey",
        description="Deterministic idempotency keys for the tool calls of AI agents.",
    )
    parser.add_argument("--version", action="version", version=f"agentkey {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    key = sub.add_parser("key", help="print the Idempotency-Key of one step")
    key.add_argument("--plan", help="plan session id (default: a new random one)")
    key.add_argument("--step", type=_step_index, required=True, help="step index, e.g. 3 or 3.1")
    key.add_argument("--tool", default="tool", help="tool name (not part of the key)")
    key.add_argument("--args", required=True, help="the arguments as a JSON object")
    key.add_argument("--style", choices=("raw", "sf-string"), default="raw")
    key.set_defaults(func=_cmd_key)

    demo = sub.add_parser(
        "demo",
        help="run a plan against an in-process tool server: lost answers, races, restarts, "
        "replans (no outside services)",
    )
    demo.set_defaults(func=_cmd_demo)

    check = sub.add_parser(
        "check",
        help="check that a tool server honours the idempotency contract (real side effects!)",
        description="Check each point of the idempotency contract against a live tool server "
        "and print a pass/fail table; exit status 1 if any point fails. " + _CHECK_WARNING,
    )
    check.add_argument("url", help="base URL of the tool server, e.g. https://tools.example.com")
    check.add_argument("--path", required=True, help="the tool's path, e.g. /tools/provision")
    check.add_argument("--args", required=True, help="valid tool arguments as a JSON object")
    check.add_argument(
        "--changed-args",
        help="a different valid argument object (default: --args plus a nonce field)",
    )
    check.add_argument(
        "--token",
        help="bearer token (never printed; default: $AGENTKEY_CHECK_TOKEN, which keeps it "
        "out of the process list)",
    )
    check.add_argument("--style", choices=("raw", "sf-string"), default="raw")
    check.add_argument("--concurrency", type=int, default=8, help="size of the concurrent burst")
    check.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    check.set_defaults(func=_cmd_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    ns = _parser().parse_args(argv)
    try:
        code: int = ns.func(ns)
    except AgentKeyError as exc:
        print(f"agentkey: {exc}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
