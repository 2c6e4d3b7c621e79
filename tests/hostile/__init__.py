"""Hostile peers: servers that attack the client, clients that attack the server."""
