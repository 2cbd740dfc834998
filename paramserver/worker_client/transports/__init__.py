"""paramserver.worker_client.transports."""
