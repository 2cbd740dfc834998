"""Wire types of paramserver, generated from protos/ at build time."""
