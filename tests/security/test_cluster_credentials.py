"""Secured etcd and NATS, with the real servers: etcd with auth (user/password), etcd
over TLS with a client certificate, NATS over TLS with a user and password that is
never echoed in an error, NATS in operator mode with a user's .creds file (JWT + nkey)."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest

from kvmesh.errors import CannotConnect, KvmeshError
from kvmesh.runtime.discovery.etcd import EtcdCredentials, EtcdDiscovery
from kvmesh.runtime.nats import connect_nats, nats_tls_context
from tests.helpers import free_port
from tests.security.certs import make_certs
from tests.services import _stop, _wait_port, binary

pytestmark = [pytest.mark.timeout(90), pytest.mark.processes]


@contextlib.contextmanager
def _process(cmd: list[str], port: int, log: Path):
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_port(port, proc)
        yield proc
    finally:
        _stop(proc)


async def _roundtrip(disc: EtcdDiscovery) -> None:
    await disc.connect()
    try:
        await disc.put("/kvmesh-sec/a", b"1")
        assert await disc.get_prefix("/kvmesh-sec/") == {"/kvmesh-sec/a": b"1"}
    finally:
        await disc.close()


async def test_etcd_with_auth(etcd):
    etcd.etcdctl("user", "add", "root", "--new-user-password", "s3cret-pw")
    etcd.etcdctl("auth", "enable")
    await _roundtrip(EtcdDiscovery([etcd.endpoint], credentials=EtcdCredentials(user="root", password="s3cret-pw")))
    anonymous = EtcdDiscovery([etcd.endpoint], connect_timeout_s=2)
    await anonymous.connect()
    try:
        with pytest.raises(KvmeshError) as exc:
            await anonymous.put("/kvmesh-sec/b", b"2")
        assert "s3cret" not in str(exc.value)
    finally:
        await anonymous.close()
    wrong = EtcdDiscovery([etcd.endpoint], connect_timeout_s=2, credentials=EtcdCredentials(user="root", password="nope"))
    with pytest.raises(KvmeshError):
        await wrong.connect()
        await wrong.put("/kvmesh-sec/b", b"2")
    await wrong.close()
    assert "s3cret" not in repr(EtcdCredentials(user="root", password="s3cret-pw"))


async def test_etcd_over_tls_with_a_client_certificate(tmp_path):
    c = make_certs(tmp_path)
    port, peer = free_port(), free_port()
    url = f"https://127.0.0.1:{port}"
    cmd = [binary("etcd"), "--name", "tls", "--data-dir", str(tmp_path / "data"),
           "--listen-client-urls", url, "--advertise-client-urls", url,
           "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
           "--initial-cluster", f"tls=http://127.0.0.1:{peer}",
           "--cert-file", c["server.pem"], "--key-file", c["server.key"],
           "--trusted-ca-file", c["ca.pem"], "--client-cert-auth"]  # fmt: skip
    with _process(cmd, port, tmp_path / "etcd.log"):
        creds = EtcdCredentials(ca_file=c["ca.pem"], cert_file=c["client.pem"], key_file=c["client.key"])
        await _roundtrip(EtcdDiscovery([url], credentials=creds))
        no_cert = EtcdDiscovery([url], connect_timeout_s=2, credentials=EtcdCredentials(ca_file=c["ca.pem"]))
        with pytest.raises(CannotConnect):
            await no_cert.connect()
        plain = EtcdDiscovery([f"http://127.0.0.1:{port}"], connect_timeout_s=2)
        with pytest.raises(CannotConnect):
            await plain.connect()


async def test_nats_over_tls_with_a_password_that_is_never_echoed(tmp_path):
    c = make_certs(tmp_path)
    port = free_port()
    cmd = [binary("nats-server"), "-a", "127.0.0.1", "-p", str(port), "--tls", "--tlscert", c["server.pem"],
           "--tlskey", c["server.key"], "--user", "kv", "--pass", "n4ts-pw"]  # fmt: skip
    with _process(cmd, port, tmp_path / "nats.log"):
        tls = nats_tls_context(c["ca.pem"])
        nc = await connect_nats(f"tls://kv:n4ts-pw@127.0.0.1:{port}", tls=tls)
        try:
            await nc.publish("x", b"1")
            await nc.flush()
        finally:
            await nc.close()
        with pytest.raises(CannotConnect) as exc:
            await connect_nats(f"tls://kv:wr0ng-pw@127.0.0.1:{port}", tls=tls, connect_timeout=1, first_connect_attempts=1)
        assert "wr0ng-pw" not in exc.value.message and "***@" in exc.value.message
        with pytest.raises(CannotConnect, match="CERTIFICATE_VERIFY_FAILED"):  # a server it cannot verify: no hang
            await connect_nats(f"tls://kv:n4ts-pw@127.0.0.1:{port}", tls=nats_tls_context(c["client.pem"]),
                               connect_timeout=1, first_connect_attempts=1)  # fmt: skip


# ---------------------------------------------------------------------------- NATS .creds (JWT + nkey)


def _b64(data: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _keypair(prefix: int):  # type: ignore[no-untyped-def]
    import os

    import nkeys

    return nkeys.from_seed(nkeys.encode_seed(os.urandom(32), prefix))


def _jwt(signer, subject: str, name: str, nats: dict[str, object]) -> str:  # type: ignore[no-untyped-def]
    """A NATS JWT (decentralized auth): claims signed with the issuer's nkey (ed25519)."""
    import hashlib
    import json
    import time

    claims: dict[str, object] = {"jti": "", "iat": int(time.time()), "iss": signer.public_key.decode(), "name": name,
                                 "sub": subject, "nats": nats}  # fmt: skip
    claims["jti"] = _b64(hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest())
    head = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = _b64(json.dumps(claims).encode())
    return f"{head}.{body}.{_b64(signer.sign(f'{head}.{body}'.encode()))}"


def _creds(path: Path, user_jwt: str, seed: bytes) -> str:
    path.write_text(
        f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{seed.decode()}\n------END USER NKEY SEED------\n"
    )
    path.chmod(0o600)
    return str(path)


_UNLIMITED = {"subs": -1, "data": -1, "payload": -1}


async def test_nats_with_a_creds_file_and_refused_without_or_with_a_foreign_user(tmp_path: Path) -> None:
    """nats-server in operator mode (memory resolver): kvmesh's connection with the user's
    .creds file works; without credentials, or with a user another account signed, it is
    refused with an error that names the server but no secret."""
    import nkeys

    operator, account, user = (_keypair(p) for p in (nkeys.PREFIX_BYTE_OPERATOR, nkeys.PREFIX_BYTE_ACCOUNT, nkeys.PREFIX_BYTE_USER))
    limits = {**_UNLIMITED, "imports": -1, "exports": -1, "wildcards": True, "conn": -1, "leaf": -1,
              "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}  # fmt: skip
    op_jwt = _jwt(operator, operator.public_key.decode(), "op", {"type": "operator", "version": 2})
    acc_jwt = _jwt(operator, account.public_key.decode(), "acc",
                   {"limits": limits, "default_permissions": {"pub": {}, "sub": {}}, "type": "account", "version": 2})  # fmt: skip
    user_claims = {"pub": {}, "sub": {}, **_UNLIMITED, "type": "user", "version": 2}
    good = _creds(tmp_path / "user.creds", _jwt(account, user.public_key.decode(), "u", user_claims), user.seed)
    rogue_account, rogue = _keypair(nkeys.PREFIX_BYTE_ACCOUNT), _keypair(nkeys.PREFIX_BYTE_USER)
    foreign = _creds(tmp_path / "rogue.creds", _jwt(rogue_account, rogue.public_key.decode(), "r", user_claims), rogue.seed)
    port = free_port()
    conf = tmp_path / "nats.conf"
    conf.write_text(
        f"listen: 127.0.0.1:{port}\noperator: {op_jwt}\nresolver: MEMORY\n"
        f"resolver_preload: {{ {account.public_key.decode()}: {acc_jwt} }}\n"
    )
    url = f"nats://127.0.0.1:{port}"
    with _process([binary("nats-server"), "-c", str(conf)], port, tmp_path / "nats.log"):
        nc = await connect_nats(url, user_credentials=good)
        try:
            await nc.publish("kvmesh.creds", b"ok")
            await nc.flush(timeout=5)
            assert nc.is_connected
        finally:
            await nc.close()
        for creds in (None, foreign):
            with pytest.raises(CannotConnect) as refused:
                await connect_nats(url, user_credentials=creds, connect_timeout=2.0, first_connect_attempts=1)
            assert f"127.0.0.1:{port}" in refused.value.message
            assert user.seed.decode() not in refused.value.message and rogue.seed.decode() not in refused.value.message
