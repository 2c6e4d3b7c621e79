"""The loopback identity provider of tests/auth, in a process of its own
(``python -m tests.chaos._idp <port> <token lifetime> <client id> <client secret>``).

Its ``/token`` issues client-credentials tokens that live a few seconds; the tool server
checks a bearer token by asking its ``/tool``. Run apart from pytest's process so that
nothing there (a warning turned into an error, the GIL) can stall it.
"""

from __future__ import annotations

import sys

import uvicorn

from tests.auth._idp import IdP


def main(argv: list[str]) -> None:
    port, lifetime, client_id, client_secret = argv
    idp = IdP(clients={client_id: client_secret})
    idp.lifetime = float(lifetime)
    idp.url = f"http://127.0.0.1:{port}"
    uvicorn.run(
        idp.app(),
        host="127.0.0.1",
        port=int(port),
        log_level="warning",
        access_log=False,
        lifespan="off",
        backlog=1024,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
