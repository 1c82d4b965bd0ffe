"""House rules of the harness's own code that no linter checks: bench/, scripts/ and conf/ give
their reasons with the docs section that explains them, never a dated note under results/, and
every docs section they name exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The harness's own code and configs (methods/ and models/ follow in their own pass).
SCOPE = ("bench", "scripts", "conf")
# A dated note: results/<area>/YYYYmmdd-<what>.md (data files such as profiles are not notes).
DATED_NOTE = re.compile(r"results/[a-z_-]+/20\d{6}[-\w]*\.md")
# A docs section named in code: docs/<topic>.md, "Section" (or ("Section"), or "Section").
DOCS_SECTION = re.compile(r'(docs/[a-z-]+\.md),? \(?"([^"]+)"')


def _files() -> list[Path]:
    files = []
    for top in SCOPE:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in (".py", ".yaml", ".sh") or (path.is_file() and path.parent.name == "scripts"):
                files.append(path)
    return [p for p in files if p.is_file() and "__pycache__" not in p.parts]


def _headings(doc: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in doc.read_text().splitlines() if line.startswith("#")]


def test_scope_has_files():
    assert len(_files()) > 50


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_code_cites_docs_sections_not_dated_notes(path: Path):
    text = path.read_text(errors="replace")
    notes = DATED_NOTE.findall(text)
    assert not notes, f"{path.relative_to(ROOT)} cites dated notes {notes}: give the reason and its docs section"
    for doc, section in DOCS_SECTION.findall(text):
        assert (ROOT / doc).is_file(), f"{path.relative_to(ROOT)} names {doc}, which does not exist"
        headings = _headings(ROOT / doc)
        assert any(section in h for h in headings), (
            f'{path.relative_to(ROOT)} names {doc}, "{section}": no such section; sections: {headings}'
        )


def test_the_rule_catches_a_dated_note_and_a_missing_section():
    assert DATED_NOTE.findall("spread (results/emulation/20261125-steady-allocator.md).")
    assert not DATED_NOTE.findall("a profile in results/profiles/H200-20261126-0420.json")
    assert DOCS_SECTION.findall('slower (docs/emulation.md, "The pause discount").') == [
        ("docs/emulation.md", "The pause discount")
    ]
    assert DOCS_SECTION.findall('as docs/records.md ("Metrics") defines') == [("docs/records.md", "Metrics")]


def test_each_command_module_has_a_name_no_other_module_of_bench_has():
    from bench.cli import COMMANDS

    commands = {module.rpartition(".")[2] for module, _ in COMMANDS.values()}
    assert all((ROOT / "bench" / f"{name}.py").is_file() for name in commands)
    clashes = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "bench").rglob("*")
        if path.parent != ROOT / "bench" and (path.stem if path.suffix == ".py" else path.name) in commands
    )
    assert not clashes, f"modules named as a command (python -m bench.<command>) elsewhere in bench: {clashes}"


def test_no_two_modules_of_bench_share_a_name():
    """One name, one module: `settings` or `links` means one thing anywhere in bench/."""
    seen: dict[str, list[str]] = {}
    for path in (ROOT / "bench").rglob("*.py"):
        if path.name != "__init__.py":
            seen.setdefault(path.stem, []).append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not shared, f"modules of bench/ that share a name: {shared}"
