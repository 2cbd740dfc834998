"""Demos and launchers: the digits and MovieLens jobs, the local cluster, the SPMD demo, the
plot."""
