"""A griffe extension for the docs build: agentkey's docstrings use Sphinx roles.

The docstrings cross-reference with reStructuredText roles (``:class:`Claim```,
``:meth:`~Claim.keep_alive```). mkdocstrings reads them as Markdown, where a role is
plain text, so the API page showed them raw. This rewrites each role, once the package is
loaded, into an optional cross-reference: a link where the target is documented, the
name in code type where it is not. ``mkdocs.yml`` loads it; nothing at run time does.
"""

from __future__ import annotations

import re
from html import escape
from typing import Any

import griffe

#: ``:class:`X```, ``:py:meth:`~a.b.C.m```; a role with an explicit title
#: (``:class:`title <target>```) keeps the title.
_ROLE = re.compile(
    r":(?:py:)?(?P<role>class|meth|func|attr|exc|mod|data|obj|const):"
    r"`(?P<short>~?)(?P<target>[^`]+?)`"
)
_CALLABLE = {"meth", "func"}


class SphinxRoles(griffe.Extension):
    """Replace Sphinx cross-reference roles in every docstring of the loaded package."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Rewrite the docstrings of ``pkg`` and everything it defines."""
        self._walk(pkg, set())

    def _walk(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(lambda m: _reference(obj, m), obj.docstring.value)
        for member in obj.members.values():
            if not member.is_alias and isinstance(member, griffe.Object):
                self._walk(member, seen)


def _reference(obj: griffe.Object, match: re.Match[str]) -> str:
    target = match["target"].strip()
    title = target
    explicit = re.fullmatch(r"(?P<title>.+?)\s*<(?P<target>[^<>]+)>", target)
    if explicit:
        title, target = explicit["title"], explicit["target"]
    elif match["short"]:
        title = target.rsplit(".", 1)[-1]
    if match["role"] in _CALLABLE and not explicit and not title.endswith(")"):
        title += "()"
    identifier = _resolve(obj, target)
    text = f"<code>{escape(title)}</code>"
    if identifier is None:
        return text
    return f'<autoref identifier="{escape(identifier)}" optional>{text}</autoref>'


def _resolve(obj: griffe.Object, target: str) -> str | None:
    """The full path ``target`` names, seen from ``obj``'s scope (None if unknown)."""
    if target.startswith("agentkey."):
        return target
    head, _, rest = target.partition(".")
    scope: griffe.Object | None = obj
    while scope is not None:
        try:
            found = scope.resolve(head)
        except (griffe.NameResolutionError, KeyError, ValueError):
            scope = scope.parent
            continue
        return f"{found}.{rest}" if rest else found
    return None
