"""Certificates and keys of the local control plane, made with the ``openssl`` command.

Data flow: :func:`make_pki` writes every file into one folder (``<run>/pki``) and returns their
paths; the cluster module hands them to the processes by flag. One CA signs everything: the
apiserver's serving certificate, the admin client certificate (group ``system:masters``) and the
LWS webhook's serving certificate. The service-account signing key is a separate RSA key pair.
Everything is loopback-only test material, regenerated for each fresh cluster.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

CA_DAYS = 3650
CERT_DAYS = 825


class PKIError(RuntimeError):
    """openssl is missing or one of its commands failed."""


@dataclass(frozen=True)
class PKI:
    """Paths of the generated files (all inside one folder)."""

    ca_crt: Path
    ca_key: Path
    apiserver_crt: Path
    apiserver_key: Path
    admin_crt: Path
    admin_key: Path
    webhook_dir: Path  # holds tls.crt / tls.key, the layout controller-runtime expects
    sa_key: Path
    sa_pub: Path


def _openssl(*args: str) -> None:
    """Run one openssl command; raise :class:`PKIError` with its stderr on failure."""
    exe = shutil.which("openssl")
    if exe is None:
        raise PKIError("the 'openssl' command is required (Debian package: openssl)")
    proc = subprocess.run([exe, *args], capture_output=True, text=True, check=False, timeout=60)
    if proc.returncode != 0:
        raise PKIError(f"openssl {' '.join(args[:2])} failed: {proc.stderr.strip()}")


def _ec_key(path: Path) -> None:
    _openssl(
        "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path)
    )


def _signed_cert(
    folder: Path, name: str, subject: str, ca: tuple[Path, Path], ext: str
) -> tuple[Path, Path]:
    """Key + certificate ``<name>.crt`` signed by ``ca`` with the x509v3 extensions ``ext``."""
    key, csr, crt, extfile = (folder / f"{name}.{s}" for s in ("key", "csr", "crt", "ext"))
    _ec_key(key)
    _openssl("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr))
    extfile.write_text(ext)
    ca_crt, ca_key = ca
    _openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca_crt),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-days",
        str(CERT_DAYS),
        "-sha256",
        "-extfile",
        str(extfile),
        "-out",
        str(crt),
    )
    csr.unlink()
    extfile.unlink()
    return crt, key


def _server_ext(dns: list[str], ips: list[str]) -> str:
    alt = ",".join([f"DNS:{d}" for d in dns] + [f"IP:{i}" for i in ips])
    return (
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        f"extendedKeyUsage=serverAuth\nsubjectAltName={alt}\n"
    )


CLIENT_EXT = (
    "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
    "extendedKeyUsage=clientAuth\n"
)


def make_pki(folder: Path, *, service_ip: str, extra_ips: list[str] | None = None) -> PKI:
    """Create the CA, serving and client certificates and the service-account keys in ``folder``.

    ``service_ip`` is the first address of the service range (the ``kubernetes`` Service), which
    in-cluster clients dial; it goes into the apiserver certificate's SANs.
    """
    folder.mkdir(parents=True, exist_ok=True)
    ca_crt, ca_key = folder / "ca.crt", folder / "ca.key"
    _ec_key(ca_key)
    _openssl(
        "req",
        "-x509",
        "-new",
        "-key",
        str(ca_key),
        "-subj",
        "/CN=cas-local-ca",
        "-days",
        str(CA_DAYS),
        "-sha256",
        "-out",
        str(ca_crt),
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
    )
    ca = (ca_crt, ca_key)
    api_dns = [
        "localhost",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    ]
    api_crt, api_key = _signed_cert(
        folder,
        "apiserver",
        "/CN=kube-apiserver",
        ca,
        _server_ext(api_dns, list(dict.fromkeys(["127.0.0.1", service_ip, *(extra_ips or [])]))),
    )
    admin_crt, admin_key = _signed_cert(
        folder, "admin", "/O=system:masters/CN=cas-admin", ca, CLIENT_EXT
    )
    webhook_dir = folder / "lws-webhook"
    webhook_dir.mkdir(exist_ok=True)
    _signed_cert(
        webhook_dir, "tls", "/CN=lws-webhook", ca, _server_ext(["localhost"], ["127.0.0.1"])
    )
    sa_key, sa_pub = folder / "sa.key", folder / "sa.pub"
    _openssl(
        "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(sa_key)
    )
    _openssl("pkey", "-in", str(sa_key), "-pubout", "-out", str(sa_pub))
    for key_file in folder.rglob("*.key"):
        key_file.chmod(0o600)
    return PKI(
        ca_crt=ca_crt,
        ca_key=ca_key,
        apiserver_crt=api_crt,
        apiserver_key=api_key,
        admin_crt=admin_crt,
        admin_key=admin_key,
        webhook_dir=webhook_dir,
        sa_key=sa_key,
        sa_pub=sa_pub,
    )
