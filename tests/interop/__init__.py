"""agentkey against idempotency libraries and clients that already exist."""
