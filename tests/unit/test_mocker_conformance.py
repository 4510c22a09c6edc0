"""The mocker passes the engine conformance kit."""

from kvmesh.engines.mocker import MockerEngine, MockerOptions
from kvmesh.testing import run_conformance


async def test_mocker_passes_the_conformance_kit():
    ran = await run_conformance(lambda: MockerEngine(MockerOptions(speedup=100.0)))
    assert len(ran) == 8


async def test_mocker_at_full_speed_passes_too():
    await run_conformance(lambda: MockerEngine(MockerOptions(speedup=1e9)))
