"""`mypy --strict` over src/kvmesh (configured in pyproject.toml, [tool.mypy]) as a test,
so that the README's test command (and .ci/run) runs the type checker.

A failure lists every error mypy reported. To run the checker alone: `mypy` from the
repository root. Each `# type: ignore` in src/ names its error code and gives a reason.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "kvmesh"

pytest.importorskip("mypy", reason="mypy is in the test extra: pip install -e '.[test]'")


@pytest.mark.slow
@pytest.mark.timeout(900)  # a cold run over the whole tree takes ~1.5 min on a loaded 2-core machine
def test_mypy_strict_passes() -> None:
    from mypy import api

    cache = ROOT / ".mypy_cache"  # reused between runs (ignored by git); a cold run is slower, not different
    stdout, stderr, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(cache), str(SRC)])
    errors = [line for line in stdout.splitlines() if ": error:" in line]
    assert status == 0 and not errors, (
        f"mypy --strict found {len(errors)} error(s) in src/kvmesh (fix them; see [tool.mypy] in pyproject.toml):\n"
        + "\n".join(errors or stdout.splitlines())
        + (f"\n{stderr}" if stderr else "")
    )


def test_every_type_ignore_names_its_code_and_reason() -> None:
    """`# type: ignore[code]  # why`: a bare ignore, or one without a reason, hides errors nobody can judge."""
    bad = []
    pattern = re.compile(r"#\s*type:\s*ignore(?!\[[a-z-]+(?:,\s*[a-z-]+)*\]\s+#\s*\S)")
    for path in sorted(SRC.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not bad, "type: ignore without an error code and a reason:\n" + "\n".join(bad)
