"""paramserver: an asyncio, gRPC-networked parameter server with an SPMD block-transfer layer.

Importing this package creates no asyncio objects and opens no sockets.
"""

__version__ = "0.1.0"
