"""paramserver inside other systems: the PyTorch adapter (:mod:`paramserver.integrations.torch`) and
Ray (:mod:`paramserver.integrations.ray`). Each needs its extra (``paramserver[torch]``, ``[ray]``).
"""
