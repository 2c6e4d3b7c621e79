"""The client half: invokers, the flow engine and its drivers, the wire, hooks, policies.

Every module here is private; the public names are re-exported by ``agentkey``. Importing
this package loads nothing: each module loads when ``agentkey`` first needs one of its names.

- ``_effects``: the vocabulary the core and the drivers share (requests out, answers in).
- ``_protocol`` (how one answer is judged), ``_flow`` (one call as a generator of effects),
  ``_drive`` (the sync and async drivers), ``_invoker`` (the public invokers).
- The wire, the only modules that touch httpx: ``_clients`` (the clients agentkey builds),
  ``_httpx2`` (a user's httpx2 client), ``_http`` (one request sent and read), ``_decode``
  (bounded body decoding), ``_translate`` (httpx errors to failures), ``_deadline`` (the
  sync deadline watchdog).
- ``_policies``, ``_hooks``, ``_net``, ``_retry_after``, and ``_checker`` (``agentkey check``).
"""
