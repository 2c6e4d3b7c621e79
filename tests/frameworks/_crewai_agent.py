"""An agent process for the CrewAI recovery tests: one job, a CrewAI Flow persisted with
``@persist`` in a SQLite file, whose step runs a crew calling the charge tool over HTTP.

    python -m tests.frameworks._crewai_agent --url URL --flows PATH --state-id ID

The flow is kicked off with ``inputs={"id": ID}``, CrewAI's recipe to resume a persisted
flow (the first time too, so the test knows the id). The journal is ``$AGENTKEY_JOURNAL``.
The tool's records are printed as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import sys

from crewai.flow.persistence import SQLiteFlowPersistence

from agentkey import ToolInvoker
from tests.frameworks._crewai import FAST, shop_flow


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--flows", required=True)
    parser.add_argument("--state-id", required=True)
    ns = parser.parse_args()
    with ToolInvoker(ns.url, route_template="/tools/{tool}", retry=FAST, timeout=30) as invoker:
        flow = shop_flow(invoker, SQLiteFlowPersistence(ns.flows))
        flow.kickoff(inputs={"id": ns.state_id})
    for record in flow.state.records:
        print(json.dumps({"record": record}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
