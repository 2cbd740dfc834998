"""Fault-injection suite (issue 5): real server and worker processes on 127.0.0.1, killed,
stopped and restarted on purpose; every test is bounded in time and polls instead of sleeping."""
