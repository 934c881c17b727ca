"""Certificates for the TLS rows: one CA (EC P-256, made with openssl as
docs/security.md shows), a server and a client certificate, laid out for
both tools:

* QEMU's tls-creds-x509 directories: `qemu-server/` (ca-cert.pem,
  server-cert.pem, server-key.pem) and `qemu-client/` (ca-cert.pem,
  client-cert.pem, client-key.pem);
* tern's --tls-dir: `tern-server/` and `tern-client/` (ca.pem, cert.pem,
  key.pem).

The server certificate holds IP:127.0.0.1, the address both sources dial."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _host(root: Path, name: str, san: str) -> tuple[Path, Path]:
    key, cert, csr = root / f"{name}.key", root / f"{name}.pem", root / f"{name}.csr"
    ext = root / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\nbasicConstraints=CA:FALSE\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(root / "ca.pem"),
             "-CAkey", str(root / "ca.key"), "-CAcreateserial", "-days", "2",
             "-out", str(cert), "-extfile", str(ext))
    return cert, key


def make(root: Path) -> Path:
    """Writes the CA and both layouts under `root` (replaced); returns it."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-nodes", "-keyout", str(root / "ca.key"), "-out", str(root / "ca.pem"),
             "-days", "2", "-subj", "/CN=ternbench CA")
    server = _host(root, "server", "IP:127.0.0.1,DNS:localhost")
    client = _host(root, "client", "DNS:client.ternbench")
    for role, (cert, key) in (("server", server), ("client", client)):
        qemu_dir, tern_dir = root / f"qemu-{role}", root / f"tern-{role}"
        qemu_dir.mkdir()
        tern_dir.mkdir()
        shutil.copy(root / "ca.pem", qemu_dir / "ca-cert.pem")
        shutil.copy(cert, qemu_dir / f"{role}-cert.pem")
        shutil.copy(key, qemu_dir / f"{role}-key.pem")
        shutil.copy(root / "ca.pem", tern_dir / "ca.pem")
        shutil.copy(cert, tern_dir / "cert.pem")
        shutil.copy(key, tern_dir / "key.pem")
    return root
