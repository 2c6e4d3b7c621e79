"""Tests of the ToolInvoker: I/O-free core, scenario table on both drivers, loopback end to end."""
