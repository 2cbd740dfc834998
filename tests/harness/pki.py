"""Certificates and token files generated in the test (``cryptography``): a CA, a server
certificate for 127.0.0.1 / localhost (subjectAltName), a client certificate of the same CA, and
a client certificate of another CA (which a mutual-TLS server must refuse)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    """Paths of the PEM files (strings, as the flags take them)."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str
    other_client_cert: str
    other_client_key: str


@dataclass(frozen=True)
class Tokens:
    """A token file with one worker and one admin token, and both tokens."""

    path: str
    worker: str
    admin: str
    worker_file: str
    admin_file: str


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> str:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    os.chmod(path, 0o600)
    return str(path)


def _write_cert(path: Path, cert: x509.Certificate) -> str:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


def _ca(name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], name: str, *, server: bool
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    ca_cert, ca_key = ca
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                if server
                else [ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
    return builder.sign(ca_key, hashes.SHA256()), key


def make_pki(directory: Path) -> Pki:
    """Generate every certificate and key under ``directory`` (EC P-256, valid one day)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = _ca("paramserver test CA")
    other = _ca("another CA")
    server = _leaf(ca, "paramserver server", server=True)
    client = _leaf(ca, "paramserver worker", server=False)
    stranger = _leaf(other, "stranger", server=False)
    d = directory
    return Pki(
        ca=_write_cert(d / "ca.pem", ca[0]),
        server_cert=_write_cert(d / "server.pem", server[0]),
        server_key=_write_key(d / "server.key", server[1]),
        client_cert=_write_cert(d / "client.pem", client[0]),
        client_key=_write_key(d / "client.key", client[1]),
        other_ca=_write_cert(d / "other-ca.pem", other[0]),
        other_client_cert=_write_cert(d / "other-client.pem", stranger[0]),
        other_client_key=_write_key(d / "other-client.key", stranger[1]),
    )


def make_tokens(directory: Path) -> Tokens:
    """A token file (``worker TOKEN`` / ``admin TOKEN``, mode 600) and one file per token."""
    directory.mkdir(parents=True, exist_ok=True)
    worker, admin = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    path = directory / "tokens"
    path.write_text(f"# role token\nworker {worker}\n\nadmin  {admin}  # operators\n")
    os.chmod(path, 0o600)
    files = []
    for name, token in (("worker.token", worker), ("admin.token", admin)):
        f = directory / name
        f.write_text(token + "\n")
        os.chmod(f, 0o600)
        files.append(str(f))
    return Tokens(str(path), worker, admin, files[0], files[1])
