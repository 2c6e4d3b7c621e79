"""The Python examples in README.md and docs/ run, so the docs cannot drift from the code.

Each file's ```python blocks run in order in one namespace, as a reader would
paste them. A block whose first line is ``# not run: <reason>`` is skipped;
the reason says why (it needs a service the reader provides).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _blocks(path: Path) -> list[str]:
    return [b for b in BLOCK.findall(path.read_text("utf-8")) if not b.startswith("# not run:")]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_run(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every runnable Python block of the file executes without error."""
    namespace: dict[str, object] = {"__name__": f"docs_{path.stem}"}
    for number, block in enumerate(_blocks(path), start=1):
        code = compile(block, f"{path.name}[block {number}]", "exec")
        exec(code, namespace)  # noqa: S102 - running our own docs is the point
    capsys.readouterr()


def test_docs_have_examples() -> None:
    """The README's quick start is runnable Python, so the test above is not vacuous."""
    assert _blocks(ROOT / "README.md")
