"""``kvmesh canary record``: record a canary set from a known-good worker.

Asks the worker at ``--worker HOST:PORT`` (its request-plane address, as in
``/admin/workers`` or discovery) for greedy answers to a few prompts and writes them as
a canary set that ``kvmesh frontend|run --canaries FILE`` checks every worker against.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

__all__ = ["add_canary_args", "run_canary"]


def add_canary_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="canary_command", required=True)
    rec = sub.add_parser("record", help="record a canary set from a known-good worker")
    rec.add_argument("--worker", required=True, help="the worker's request-plane address, host:port")
    rec.add_argument("--out", required=True, help="file to write (JSON canary set)")
    rec.add_argument("--prompt", action="append", default=[], help="a canary prompt (repeatable; default: two built-in ones)")
    rec.add_argument("--tokens", type=int, default=8, help="greedy tokens to record per prompt (default 8)")
    rec.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for each answer")


def run_canary(ns: argparse.Namespace) -> int:
    from kvmesh.errors import KvmeshError

    try:
        return asyncio.run(_record(ns))
    except KvmeshError as exc:
        print(f"kvmesh canary record: {exc.message}", file=sys.stderr)
        return 1
    except (TimeoutError, OSError) as exc:
        print(f"kvmesh canary record: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


async def _record(ns: argparse.Namespace) -> int:
    import msgspec

    from kvmesh.frontend.models import fetch_model_files
    from kvmesh.health.canary import CanaryOutput, record_canaries, save_canaries
    from kvmesh.health.monitor import DEFAULT_CANARY_PROMPTS, generate_greedy
    from kvmesh.preprocess import Preprocessor
    from kvmesh.protocol import InstanceInfo
    from kvmesh.runtime.distributed import call
    from kvmesh.runtime.names import INFO
    from kvmesh.runtime.tcp_client import TcpClient

    client = TcpClient(ns.worker, response_timeout=ns.timeout)
    try:
        info = await call(client, INFO, decode=msgspec.msgpack.Decoder(InstanceInfo).decode)
        if info is None:
            print(f"kvmesh canary record: the worker at {ns.worker} sent no card", file=sys.stderr)
            return 1
        model = info.engine.served_model_name
        pre = Preprocessor.from_folder(await fetch_model_files(client, model), name=model)
        outputs = []
        for text in ns.prompt or DEFAULT_CANARY_PROMPTS:
            prompt = pre.text_prompt(text)
            tokens, top = await asyncio.wait_for(generate_greedy(client, model, prompt, ns.tokens), ns.timeout)
            outputs.append(CanaryOutput(prompt, tokens, top, name=text))
        save_canaries(ns.out, record_canaries(outputs, model=model))
        print(f"kvmesh: recorded {len(outputs)} canaries for {model!r} from {ns.worker} into {ns.out}")
        return 0
    finally:
        await client.close()
