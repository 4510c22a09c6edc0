"""The models' chat templates compiled in a forked process, beside the start (issue 36).

``kvmesh run`` must not start over a chat template that does not compile, but importing
jinja2 and compiling the template (~0.15 s of a loaded box) in the frontend's process
sits on the way to its first completion. :meth:`TemplateCheck.fork` forks a short-lived
process (niced: a spare core's work), before the event loop exists, that imports jinja2
and compiles each model's template while the frontend builds its HTTP stack, and writes
the first error back through a pipe; :meth:`TemplateCheck.result` waits for it once the
frontend serves, before its serving line (a broken template: ``kvmesh run`` exits 1 with
its error). The frontend's own copy of a template is compiled by its first chat
request (:class:`~kvmesh.preprocess.preprocessor.Preprocessor` ``defer_template``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

from kvmesh.errors import KvmeshError
from kvmesh.preprocess.model import load_model_folder

__all__ = ["TemplateCheck"]

_MAX_ERROR = 64 * 1024  # bytes of an error message read back
_NICE = 10
_OK = b"done:"  # the check's reply starts so: then its error, if any


class TemplateCheck:
    """A forked check of model folders' chat templates (see the module docstring)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    @classmethod
    def fork(cls, folders: Sequence[tuple[str, str | None]]) -> TemplateCheck:
        """Fork the check of each (folder, served name)'s template. Call before any event
        loop or thread exists (as the workers are forked). The check runs in a grandchild
        (its parent exits at once and is reaped here): it is no child of ``kvmesh run``,
        whose children are its workers."""
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the children (their result is what the tests see)
            try:
                os.close(read)
                if os.fork() == 0:
                    os.nice(_NICE)  # a spare core's work: it yields to the frontend and the workers
                    os.write(write, _OK + _check(folders).encode()[:_MAX_ERROR])
            finally:
                os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        return cls(read)

    async def result(self) -> str | None:
        """The first template's error (one line), or None if every one compiles."""
        return await asyncio.to_thread(self._wait)

    def _wait(self) -> str | None:
        chunks: list[bytes] = []
        try:
            while sum(map(len, chunks)) < _MAX_ERROR + len(_OK) and (chunk := os.read(self._fd, 4096)):
                chunks.append(chunk)
        finally:
            os.close(self._fd)
        said = b"".join(chunks)
        if not said.startswith(_OK):
            return "the chat template check exited before it finished"
        return said[len(_OK) :].decode(errors="replace") or None


def _check(folders: Sequence[tuple[str, str | None]]) -> str:
    """The first error of compiling the folders' templates ('' if none)."""
    from kvmesh.preprocess.template import ChatTemplate  # jinja2: in this process only

    try:
        for path, name in folders:
            info = load_model_folder(path, name=name)
            if info.chat_template is not None:
                ChatTemplate(info.chat_template, origin=str(info.path), variables=info.special_tokens())
    except KvmeshError as exc:
        return exc.message
    return ""
