"""The ``paramserver`` command line: one module per command (entry point
:func:`paramserver.cli.main.main`).

Demos and the process launchers used by tests and the local cluster are in
:mod:`paramserver.cli.demos`.
"""
