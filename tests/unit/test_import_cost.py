"""Heavy modules are paid for on first use (issue 36): the frontend does not import the
grammar engine until a request carries an output constraint; building the CLI's
parser (every ``kvmesh`` command, the ``kvmesh run`` process before it forks) does not
import the replay's mocker; ``kvmesh run``'s process, up to its fork, imports nothing
its workers do not need (no HTTP app, tokenizer or template engine: they are imported
after the fork, while the workers start); and a mocker worker starts without the
grammar engine (numpy, llguidance), which its first guided request loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

_HEAVY = ("numpy", "llguidance", "kvmesh.preprocess.guided", "kvmesh.engines.mocker")
# what the frontend imports after the fork (the workers need none of it)
_FRONTEND_ONLY = ("tokenizers", "jinja2", "prometheus_client", "kvmesh.frontend.app", "kvmesh.preprocess.tokenizer",
                  "kvmesh.preprocess.template", "kvmesh.preprocess.preprocessor")  # fmt: skip
_GRAMMAR = ("numpy", "llguidance", "kvmesh.preprocess.guided", "kvmesh.engines.mocker.guided")


def _loaded_after(code: str, names: tuple[str, ...] = _HEAVY) -> list[str]:
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in {names!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.timeout(150)
def test_frontend_app_imports_no_grammar_engine() -> None:
    assert _loaded_after("import kvmesh.frontend.app") == []


@pytest.mark.timeout(150)
def test_cli_parser_imports_no_engine() -> None:
    assert _loaded_after("from kvmesh.cli.main import build_parser\nbuild_parser()") == []


@pytest.mark.timeout(150)
def test_replay_names_still_import_from_the_package() -> None:
    assert "kvmesh.engines.mocker" in _loaded_after("from kvmesh.replay import replay, POLICIES, TraceError")


# what `kvmesh run` does before its workers fork: its modules, its parser, the model
# folder's check (kvmesh.assembly.embedded.prepare)
_RUN_UNTIL_FORK = """
from kvmesh.cli.main import build_parser
import kvmesh.cli.run
build_parser("run").parse_args(["run"])
from kvmesh.assembly.embedded import bundled_model_path, load_model_folder
load_model_folder(bundled_model_path())
"""


@pytest.mark.timeout(150)
def test_kvmesh_run_imports_no_frontend_only_module_before_it_forks() -> None:
    assert _loaded_after(_RUN_UNTIL_FORK, _FRONTEND_ONLY + _HEAVY) == []


@pytest.mark.timeout(150)
def test_kvmesh_run_parser_builds_only_the_run_flags() -> None:
    # another command's modules (the replay's flags) are not imported to parse `run`
    assert _loaded_after(_RUN_UNTIL_FORK, ("kvmesh.cli.replay", "kvmesh.cli.canary")) == []
    assert _loaded_after("from kvmesh.cli.main import build_parser\nbuild_parser()", ("kvmesh.cli.replay",)) == [
        "kvmesh.cli.replay"
    ]


@pytest.mark.timeout(150)
def test_preprocess_package_names_still_import() -> None:
    code = "from kvmesh.preprocess import Preprocessor, Tokenizer, ChatTemplate, StopMatcher, load_model_folder"
    assert _loaded_after(code, ("tokenizers", "jinja2")) == ["tokenizers", "jinja2"]


_MOCKER_WORKER = """
from kvmesh.config import WorkerConfig
from kvmesh.worker.main import build_engine
import kvmesh.worker.disagg
build_engine(WorkerConfig(engine="mocker"))
"""


@pytest.mark.timeout(150)
def test_mocker_worker_starts_without_the_grammar_engine() -> None:
    assert _loaded_after(_MOCKER_WORKER, _GRAMMAR + _FRONTEND_ONLY) == []


@pytest.mark.timeout(150)
def test_worker_imports_cryptography_with_its_first_seal() -> None:
    # an aggregated worker imports the prefill queue's module (disagg.queue -> runtime.seal)
    # but seals nothing: cryptography (~5 MiB of a worker's RSS) loads with the first seal
    assert _loaded_after(_MOCKER_WORKER + "import kvmesh.disagg.queue", ("cryptography",)) == []
    seal = "\n".join(("from kvmesh.runtime.auth import ClusterSecret", "from kvmesh.runtime.seal import MessageSeal",
                      "s = MessageSeal(ClusterSecret(b'k' * 32), 'x', window_s=5, max_bytes=64)",
                      "assert s.open(s.seal(b'hi', b'', 1.0), b'', 1.0) == b'hi'"))
    assert _loaded_after(seal, ("cryptography",)) == ["cryptography"]


@pytest.mark.timeout(150)
def test_frontend_builds_the_openapi_document_and_other_dialects_on_first_use() -> None:
    # /openapi.json (msgspec's JSON-schema generation, ~0.1 s), /v1/responses and
    # /v1/messages are built by their first request, not by the frontend's start
    lazy = ("kvmesh.frontend.openapi", "kvmesh.frontend.dialects.messages_api", "kvmesh.frontend.dialects.messages",
            "kvmesh.frontend.dialects.responses")  # fmt: skip
    start = "\n".join(("from kvmesh.config import FrontendConfig", "from kvmesh.frontend.app import Frontend",
                       "f = Frontend(FrontendConfig())"))
    assert _loaded_after(start, lazy) == []
    first_get = start + "\nimport asyncio\nassert b'/v1/messages' in asyncio.run(f.openapi(None)).body"
    assert _loaded_after(first_get, lazy[:2]) == list(lazy[:2])


# kvmesh run's frontend: its model loaded with the template deferred (the forked
# TemplateCheck compiles it at start), then a chat prompt built
_RUN_FRONTEND = """
from kvmesh.assembly.frontend import FrontendProcess
from kvmesh.config import FrontendConfig
from kvmesh.preprocess.model import bundled_model_path
process = FrontendProcess._build(FrontendConfig(), None, [(str(bundled_model_path()), None)], True)
import sys
print(' '.join(m for m in ('jinja2',) if m in sys.modules))
pre = next(iter(process.frontend.registry.models.values())).preprocessor
assert pre.chat_prompt([{"role": "user", "content": "hi"}])
"""


@pytest.mark.timeout(150)
def test_kvmesh_run_frontend_compiles_its_template_on_the_first_chat_prompt() -> None:
    assert _loaded_after(_RUN_FRONTEND, ("jinja2",)) == ["jinja2"]  # the first line: not before the chat prompt


_CHECK = """
import shutil, sys, tempfile, pathlib
from kvmesh.preprocess.model import bundled_model_path
from kvmesh.preprocess.template_check import TemplateCheck
import asyncio
good = str(bundled_model_path())
bad = pathlib.Path(tempfile.mkdtemp()) / "bad"
shutil.copytree(good, bad)
(bad / "chat_template.jinja").write_text("{% if %}")
print(repr(asyncio.run(TemplateCheck.fork([(good, None)]).result())))
print(repr(asyncio.run(TemplateCheck.fork([(good, None), (str(bad), "b")]).result())))
print("jinja2" in sys.modules)
shutil.rmtree(bad.parent)
"""


@pytest.mark.timeout(150)
def test_template_check_reports_a_broken_template_from_its_own_process() -> None:
    out = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    good, bad, jinja_here = out.stdout.splitlines()
    assert good == "None"
    assert "does not compile" in bad and "bad" in bad
    assert jinja_here == "False"  # compiled in the forked process only
