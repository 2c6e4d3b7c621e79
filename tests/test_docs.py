"""The Python examples in README.md and docs/ run, so the docs cannot drift from the code.

Each file's ```python blocks run in order in one namespace, as a reader would
paste them. A block whose first line is ``# not run: <reason>`` is skipped;
the reason says why (it needs a service the reader provides).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests._loops import close_leftover_loop

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _blocks(path: Path) -> list[str]:
    return [b for b in BLOCK.findall(path.read_text("utf-8")) if not b.startswith("# not run:")]


#: Pages whose examples use a framework that installs only on Python 3.11 or newer.
_NEEDS_311 = {"integrations.md": "PydanticAI"}
#: Pages whose examples use a framework that installs in a nox session of its own.
_NEEDS_SESSION = {"adk.md": ("google.adk", "adk"), "crewai.md": ("crewai", "crewai")}


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_run(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every runnable Python block of the file executes without error."""
    needs = _NEEDS_311.get(path.name)
    if needs and sys.version_info < (3, 11):
        pytest.skip(f"{path.name} uses {needs}, which needs Python 3.11+")
    if path.name in _NEEDS_SESSION:
        module, session = _NEEDS_SESSION[path.name]
        pytest.importorskip(module, reason=f"{path.name} runs in `nox -s {session}`")
    namespace: dict[str, object] = {"__name__": f"docs_{path.stem}"}
    try:
        for number, block in enumerate(_blocks(path), start=1):
            code = compile(block, f"{path.name}[block {number}]", "exec")
            exec(code, namespace)  # noqa: S102 - running our own docs is the point
    finally:
        close_leftover_loop()  # the pages call frameworks' run_sync()
    capsys.readouterr()


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_blocks_not_run_still_parse(path: Path) -> None:
    """A ``# not run`` block is still Python a reader can paste into a module: it compiles."""
    skipped = [b for b in BLOCK.findall(path.read_text("utf-8")) if b.startswith("# not run:")]
    for number, block in enumerate(skipped, start=1):
        compile(block, f"{path.name}[not-run block {number}]", "exec")


def test_docs_have_examples() -> None:
    """The README's quick start is runnable Python, so the test above is not vacuous."""
    assert _blocks(ROOT / "README.md")


_INSTALL = re.compile(r"^```bash\n(.*?)^```", re.DOTALL | re.MULTILINE)
_INLINE_INSTALL = re.compile(r"`pip install ([^`]+)`")
_DIST = "agentkey-idempotency"


def _install_lines(path: Path) -> list[list[str]]:
    """What the page tells a reader to install (bash blocks and inline), pointed at this checkout.

    Commands that start with ``pip install`` count, in a ```bash block or as inline code
    (```pip install 'agentkey-idempotency[server]'```); a `.venv/bin/pip` set-up line does not.
    """
    text = path.read_text("utf-8")
    found = [
        line.split(" #", 1)[0].strip()[len("pip install ") :]
        for block in _INSTALL.findall(text)
        for line in block.splitlines()
        if line.startswith("pip install ")
    ]
    found += _INLINE_INSTALL.findall(text)
    return [[_local(arg) for arg in shlex.split(spec)] for spec in found]


def _local(arg: str) -> str:
    """``agentkey-idempotency[server]`` becomes ``/path/to/checkout[server]``."""
    return str(ROOT) + arg[len(_DIST) :] if arg.startswith(_DIST) else arg


_PAGES = [p for p in DOCS if _blocks(p)]


def test_every_page_with_examples_says_what_to_install() -> None:
    """The quick check behind the slow docs_install run: no page leaves its reader guessing."""
    missing = [p.name for p in _PAGES if not _install_lines(p)]
    assert not missing, f"pages with Python examples but no `pip install` line: {missing}"


@pytest.mark.docs_install
@pytest.mark.timeout(900)  # a fresh venv's install outlasts the default 120 s
@pytest.mark.parametrize("path", _PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_run_from_the_pages_install_line(path: Path, tmp_path: Path) -> None:
    """A page's examples run in a venv holding only what the page's install lines bring."""
    if path.name in _NEEDS_SESSION:
        # Its nox session (`nox -s adk`, `nox -s crewai`) already builds a venv of its own from
        # the same extras and runs this page there; a second 1 GB install cost CI ~7 minutes.
        pytest.skip(f"{path.name} runs in `nox -s {_NEEDS_SESSION[path.name][1]}`")
    installs = _install_lines(path)
    assert installs, f"{path.name} has Python examples but no `pip install` line for them"
    venv.create(tmp_path / "venv", with_pip=True)
    python = tmp_path / "venv" / "bin" / "python"
    for args in installs:
        subprocess.run([python, "-m", "pip", "install", "-q", *args], check=True, timeout=900)
    script = tmp_path / "page.py"
    script.write_text("\n\n".join(_blocks(path)), "utf-8")
    result = subprocess.run(
        [python, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]


def _nav_pages() -> set[str]:
    """The pages mkdocs.yml's nav lists (``- Title: page.md`` lines)."""
    text = (ROOT / "mkdocs.yml").read_text("utf-8")
    return set(re.findall(r"^\s*- [^:\n]+: ([\w/.-]+\.md)\s*$", text, re.MULTILINE))


def test_every_page_is_in_the_nav_and_linked_from_the_index() -> None:
    """No docs page is an orphan: each is in the nav and the index links it."""
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert _nav_pages() == pages
    index = (ROOT / "docs/index.md").read_text("utf-8")
    linked = set(re.findall(r"\]\(([\w-]+\.md)(?:#[\w-]*)?\)", index))
    assert pages - {"index.md"} <= linked, sorted(pages - {"index.md"} - linked)
