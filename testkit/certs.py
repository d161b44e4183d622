"""Certificates for TLS tests, made fresh in each test: a CA and the certificates it signs (PEM bytes),
as cert-manager would issue them for a Secret of type kubernetes.io/tls."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    cert: bytes  # PEM
    key: bytes  # PEM, unencrypted PKCS#8
    serial: int


class Authority:
    def __init__(self, name: str = "test CA"):
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self._cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                      .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                      .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
                      .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                      .sign(self._key, hashes.SHA256()))
        self.cert = self._cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, name: str, client: bool = False) -> Issued:
        """A server certificate for 127.0.0.1 and localhost, or (`client`) a client certificate."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        serial = x509.random_serial_number()
        builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                   .issuer_name(self._cert.subject).public_key(key.public_key()).serial_number(serial)
                   .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH if client
                                                         else ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
        if not client:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return Issued(cert.public_bytes(serialization.Encoding.PEM), pem_key, serial)


def serial_of(der: bytes) -> int:
    """The serial number of a DER certificate (what a TLS client is shown)."""
    return x509.load_der_x509_certificate(der).serial_number


class SecretVolume:
    """A Secret mounted as the kubelet mounts it: the files live in a timestamped directory, `..data`
    links to it and each file name links through `..data`; an update writes a new directory and
    swaps `..data` in one rename, so a reader sees all old files or all new ones."""

    def __init__(self, directory, files: dict[str, bytes]):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._version = 0
        self.update(files)
        for name in files:
            (self.directory / name).symlink_to(f"..data/{name}")

    def update(self, files: dict[str, bytes]) -> None:
        self._version += 1
        payload = self.directory / f"..2026_11_29_00_00_00.{self._version}"
        payload.mkdir()
        for name, data in files.items():
            (payload / name).write_bytes(data)
        link = self.directory / "..data_tmp"
        link.symlink_to(payload.name)
        os.replace(link, self.directory / "..data")

    def path(self, name: str) -> str:
        return str(self.directory / name)
