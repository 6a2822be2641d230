"""docs/extending.md: every Python block runs, in order, in one fresh module per `## ` section;
the asserts in the blocks are the checks. What the page registers is removed afterwards."""

import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from disagg.core.policies import ROUTERS, SCHEDULERS
from disagg.hw.transport import WIRES
from disagg.models import MODELS

ROOT = Path(__file__).parent.parent
DOC = ROOT / "docs" / "extending.md"
REGISTRIES: list[dict] = [SCHEDULERS.classes, ROUTERS.classes, WIRES, MODELS]


def python_blocks(path: Path) -> dict[str, list[tuple[int, str]]]:
    """Each `## ` section's ```python blocks: (line number of the block's first line, code)."""
    sections: dict[str, list[tuple[int, str]]] = {}
    title, fence, start, lines = "(top)", None, 0, []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if fence is None and line.startswith("```"):
            fence, start, lines = line[3:].strip(), n + 1, []
        elif fence is not None and line.startswith("```"):
            if fence == "python":
                sections.setdefault(title, []).append((start, "\n".join(lines)))
            fence = None
        elif fence is not None:
            lines.append(line)
        elif line.startswith("## "):
            title = line[3:].strip()
    return sections


SECTIONS = python_blocks(DOC)


@pytest.fixture
def page(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """A fresh importable module to run a section in (a wire is registered by module name),
    from the repository root; every registry as it was, afterwards."""
    saved = [dict(r) for r in REGISTRIES]
    module = types.ModuleType("docs_extending")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.chdir(ROOT)
    yield module
    for registry, before in zip(REGISTRIES, saved, strict=True):
        registry.clear()
        registry.update(before)


def test_the_page_covers_each_kind_of_extension() -> None:
    assert list(SECTIONS) == ["A scheduler policy", "A router", "A wire", "A model"]


@pytest.mark.parametrize("title", list(SECTIONS))
def test_section_examples_run(title: str, page: types.ModuleType) -> None:
    for first_line, code in SECTIONS[title]:
        # padded so that a traceback names the line of docs/extending.md
        exec(compile("\n" * (first_line - 1) + code, str(DOC), "exec"), vars(page))


def test_the_examples_leave_no_registration_behind() -> None:
    assert "prefill-first" not in SCHEDULERS.classes and "two_choices" not in ROUTERS.classes
    assert "loopback" not in WIRES and "tinyllama-1.1b" not in MODELS
