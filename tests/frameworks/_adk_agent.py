"""An agent process for the ADK recovery tests: one turn of an ADK agent on a session kept in a
SQLite file (ADK's ``SqliteSessionService``), its tool over HTTP.

    python -m tests.frameworks._adk_agent --url URL --sessions PATH --session ID
        [--tickets N] [--resume] [--resumable]

Without ``--resume``, the user's message is sent (the first time, or re-sent after a crash:
a new invocation, whose model names its calls anew); with ``--resume``, the session's last
invocation is resumed (``runner.run_async(invocation_id=...)``, ADK's recipe under
``ResumabilityConfig``), which runs its unanswered calls again with their ids. The journal is
``$AGENTKEY_JOURNAL``. The function responses, with their agentkey records from the session's
state, are printed as JSON lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import warnings

from google.adk.apps import ResumabilityConfig
from google.adk.runners import Runner
from google.adk.sessions.sqlite_session_service import SqliteSessionService

from agentkey import ToolInvoker
from tests.frameworks._adk import FAST, app, records, turn


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--sessions", required=True)
    parser.add_argument("--session", required=True)
    parser.add_argument("--tickets", type=int, default=1)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--resumable", action="store_true")
    ns = parser.parse_args()
    service = SqliteSessionService(ns.sessions)
    session = await service.get_session(app_name="shop", user_id="user-1", session_id=ns.session)
    if session is None:
        session = await service.create_session(
            app_name="shop", user_id="user-1", session_id=ns.session
        )
    options = {}
    if ns.resumable or ns.resume:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ResumabilityConfig is marked experimental
            options["resumability_config"] = ResumabilityConfig(is_resumable=True)
    with ToolInvoker(ns.url, route_template="/tools/{tool}", retry=FAST, timeout=30) as invoker:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runner = Runner(app=app(invoker, ns.tickets, **options), session_service=service)
        if ns.resume:
            responses = await turn(
                runner, ns.session, None, invocation_id=session.events[-1].invocation_id
            )
        else:
            responses = await turn(runner, ns.session)
    kept = await records(service, ns.session)
    for response in responses:
        print(json.dumps({**response, "record": kept.get(str(response["id"]))}))
    sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(main())
