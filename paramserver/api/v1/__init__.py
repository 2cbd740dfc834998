"""Generated modules for package paramserver.api.v1 (``make protos``); never edited by hand."""
