"""What both ends of the wire share: tensor frames, row frames, shared memory, link framing, limits,
keepalive policy and the update-rule spec. Imports nothing from the server or the clients.
"""
