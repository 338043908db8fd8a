"""A griffe extension for the API reference: the package's docstrings are written for `help()` and
doctest (bare ``>>>`` blocks, Sphinx roles such as :func:`x`); in Markdown a bare ``>>>`` line is
a nested block quote and a doctest's output ``[1, 2]`` reads as a link. Here, at load time (the
source is untouched), every bare doctest block becomes a fenced ``pycon`` block and a role
becomes plain code.
"""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):`~?([^`]+)`")


def fence_doctests(text: str) -> str:
    """Wrap each run of lines that starts with ``>>>`` (outside a fence) in a ```pycon fence."""
    out, lines, i, in_fence = [], text.splitlines(), 0, False
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        if stripped.startswith("```"):
            in_fence = not in_fence
        if not in_fence and stripped.startswith(">>>"):
            indent = line[: len(line) - len(stripped)]
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].strip())
                i += 1
            out += [indent + "```pycon", *(indent + b for b in block), indent + "```"]
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(_ROLE.sub(r"`\1`", obj.docstring.value))
