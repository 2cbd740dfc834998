"""Security of every paramserver server and client: TLS and bearer tokens
(:mod:`paramserver.security.tls`), and access to the HTTP endpoints
(:mod:`paramserver.security.http_access`).
"""
