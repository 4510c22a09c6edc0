"""Test certificates made with the openssl command: a CA, and certificates it signs
for 127.0.0.1 (server and client use)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def make_certs(d: Path, names: tuple[str, ...] = ("server", "client"), ca: str = "ca") -> dict[str, str]:
    """``{file name: path}``: ``{ca}.pem``, and ``{name}.pem`` / ``{name}.key`` per name."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make test certificates")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2",
        "-subj", f"/CN=kvmesh test {ca}")  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name in names:
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext")  # fmt: skip
    files = [f"{ca}.pem"] + [f"{n}.{ext}" for n in names for ext in ("pem", "key")]
    return {f: str(d / f) for f in files}
