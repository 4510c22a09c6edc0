"""Helpers of the public-edge tests (issue 12): raw sockets, the frontend's RSS, and
"does normal traffic still flow"."""

from __future__ import annotations

import socket
import time

import httpx

from tests.helpers import ServerProcess

MODEL = "kvmesh-tiny"


def rss_mib(server: ServerProcess, field: str = "VmRSS:") -> float:
    """Resident memory of the frontend process (``kvmesh run`` itself, not its workers)."""
    with open(f"/proc/{server.proc.pid}/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field}")


def reset_peak(server: ServerProcess) -> float:
    """Start the frontend's peak RSS (VmHWM) over from its current RSS; returns it."""
    with open(f"/proc/{server.proc.pid}/clear_refs", "w") as f:
        f.write("5")
    return rss_mib(server, "VmHWM:")


def peak_mib(server: ServerProcess) -> float:
    return rss_mib(server, "VmHWM:")


def connect(server: ServerProcess, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=timeout)
    return sock


def read_all(sock: socket.socket, timeout: float = 10.0, limit: int = 1 << 20) -> tuple[bytes, bool]:
    """Everything the server sends until it closes (True) or ``timeout`` passes (False)."""
    sock.settimeout(timeout)
    out = b""
    try:
        while len(out) < limit:
            chunk = sock.recv(65536)
            if not chunk:
                return out, True
            out += chunk
    except TimeoutError:
        return out, False
    except ConnectionResetError:
        return out, True
    return out, False


def exchange(server: ServerProcess, data: bytes, timeout: float = 10.0) -> tuple[bytes, bool]:
    with connect(server) as sock:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        return read_all(sock, timeout)


def status_of(response: bytes) -> int:
    assert response.startswith(b"HTTP/1."), response[:200]
    return int(response.split(b" ", 2)[1])


def normal_request(server: ServerProcess, headers: dict[str, str] | None = None, timeout: float = 10.0) -> httpx.Response:
    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 4}
    return httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=timeout)


def assert_still_serving(server: ServerProcess, headers: dict[str, str] | None = None) -> None:
    r = normal_request(server, headers)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached within {timeout} s")
