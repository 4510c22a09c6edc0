import sys
from pathlib import Path

# tests import their shared helpers as `tests.helpers`
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest  # noqa: E402


@pytest.fixture
def etcd():
    from tests.services import etcd_server

    with etcd_server() as server:
        yield server


@pytest.fixture
def nats():
    from tests.services import nats_server

    with nats_server() as server:
        yield server
