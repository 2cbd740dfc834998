"""Security of every paramserver server and client: TLS and mutual TLS
(:mod:`paramserver.security.tls`), bearer tokens and their roles
(:mod:`paramserver.security.tokens`),
and access to the HTTP endpoints (:mod:`paramserver.security.http_access`).
"""
