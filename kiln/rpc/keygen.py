"""What ``kiln keygen`` writes besides the bundle-signing key pair (kiln.store.signing), on request: a private CA with a
server and a client certificate for TLS, and a token file with an admin and a user token.

Compose runs it once as a one-shot service; the tests and ``kiln demo`` call it for their own temporary material.
Nothing here overwrites a file that exists, so running it again keeps the keys that bundles were signed with.
"""

import datetime
import ipaddress
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kiln.store.signing import write_private

CA_CERT = "ca.pem"
SERVER_CERT, SERVER_KEY = "server.pem", "server.key"
CLIENT_CERT, CLIENT_KEY = "client.pem", "client.key"
TOKENS = "tokens"
ADMIN_TOKEN, USER_TOKEN = "admin.token", "user.token"
CERT_DAYS = 825


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def tls_material(directory: str | Path, hosts: list[str]) -> TlsFiles:
    """A CA, a server certificate valid for ``hosts`` (names or IP addresses) and a client certificate, all signed
    by that CA; keys readable by their owner only."""
    d = Path(directory).expanduser()
    d.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(d / CA_CERT, d / SERVER_CERT, d / SERVER_KEY, d / CLIENT_CERT, d / CLIENT_KEY)
    if files.ca.exists():
        return files
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kiln CA")])
    ca_cert = _certificate(ca_name, ca_key, ca_name, ca_key, is_ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = _certificate(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]), server_key,
                               ca_name, ca_key, sans=hosts, usage=ExtendedKeyUsageOID.SERVER_AUTH)
    client_key = ec.generate_private_key(ec.SECP256R1())
    client_cert = _certificate(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kiln client")]), client_key,
                               ca_name, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    for path, key in ((files.server_key, server_key), (files.client_key, client_key)):
        write_private(path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))
    files.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    files.client_cert.write_bytes(client_cert.public_bytes(serialization.Encoding.PEM))
    files.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))  # last: its presence means done
    return files


def token_files(directory: str | Path) -> tuple[Path, Path, Path]:
    """``tokens`` (the servers' table) with one admin and one user token, and each token alone in a file of its own
    for clients (``KILN_CLIENT_TOKEN_FILE``)."""
    d = Path(directory).expanduser()
    d.mkdir(parents=True, exist_ok=True)
    table, admin, user = d / TOKENS, d / ADMIN_TOKEN, d / USER_TOKEN
    if not table.exists():
        tokens = {"admin": secrets.token_urlsafe(32), "user": secrets.token_urlsafe(32)}
        write_private(admin, (tokens["admin"] + "\n").encode())
        write_private(user, (tokens["user"] + "\n").encode())
        write_private(table, "".join(f"{role} {token}\n" for role, token in tokens.items()).encode())
    return table, admin, user


def _certificate(subject: x509.Name, key, issuer: x509.Name, issuer_key, is_ca: bool = False,
                 sans: list[str] = (), usage=None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
               .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName([_san(h) for h in sans]), critical=False)
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if is_ca:
        builder = builder.add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False), critical=True)
    return builder.sign(issuer_key, hashes.SHA256())


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)
