"""Every reference into `docs/` resolves: the page exists, and so does the section it names.

What is read: the repository's *.py, *.md, *.toml, *.sh files and Makefiles, skipping
directories whose name starts with "." (.git, .venv, caches), `outputs/`, `__pycache__/`
and `*.egg-info/`, and this file (its examples cite made-up pages). No process is started.

The rule:

1. A page path, `docs/<name>.md` anywhere in that text, names a file that exists.
2. A section citation is a page path followed by a quoted heading, in any of the forms the
   repository writes: `docs/p.md, "Section"`, `` `docs/p.md`, "Section" ``,
   `docs/p.md ("Section")` and `docs/p.md "Section"`; or by an anchor, `docs/p.md#slug`.
   A citation may run over several lines: line breaks, the indentation and comment marker
   (`#`) that start the next line, and in Python the seam of two implicitly joined string
   literals (`'... "Held-out '` then `'documents" ...'` on the next line: a quote ending
   one line and a quote, after any string prefix, starting the next) are read as one
   space, or nothing for the seam; `\\"` reads as `"`.
3. A quoted section matches a heading of that page (any level, outside code fences) when it
   equals the heading's text after the `#`s, or that text less a trailing parenthesised
   list that starts with a backtick, the code the section covers: "Stages" names
   `### Stages (`moetrain/checkpoint/continuation.py`, `checkpoint.init_from`)`. Whitespace is
   collapsed; case counts.
4. An anchor (`docs/p.md#slug`, and the `#slug` of any Markdown link) must be the slug
   GitHub gives one of the target page's headings: lower case, every character other than
   a letter, digit, `_`, `-` or space dropped, spaces turned into `-`, and `-1`, `-2`, ...
   appended to repeats.
5. Every relative Markdown link `[text](target)` in a *.md file (outside code fences and
   code spans) points at an existing file, resolved from the linking file's directory.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_SKIP_DIRS = {"outputs", "__pycache__"}
_SUFFIXES = {".py", ".md", ".toml", ".sh"}

_PAGE = re.compile(r"(?<![\w./-])docs/((?:[\w.-]+/)*[\w.-]+\.md)")
# What may follow a page path to make it a section citation (rule 2).
_SECTION = re.compile(r'`?(?:,\s*|\s*\(\s*|\s+)"([^"]+)"')
_ANCHOR = re.compile(r"#([\w-]+)")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_FILE_LIST = re.compile(r"\s*\(`[^()]*\)\s*$")


def source_files(root: Path) -> list[Path]:
    out = []
    stack = [root]
    while stack:
        for path in sorted(stack.pop().iterdir()):
            if path.is_dir():
                name = path.name
                if not (name.startswith(".") or name in _SKIP_DIRS or name.endswith(".egg-info")):
                    stack.append(path)
            elif path.suffix in _SUFFIXES or path.name == "Makefile":
                if path.resolve() == Path(__file__).resolve():
                    continue  # its examples cite made-up pages
                out.append(path)
    return out


def _outside_fences(text: str) -> list[str]:
    """The lines of a Markdown text that are not inside ``` fences."""
    lines, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def headings(page: Path) -> list[str]:
    return [
        line.lstrip("#").strip().rstrip("#").strip()
        for line in _outside_fences(page.read_text())
        if re.match(r"#{1,6}\s", line)
    ]


def section_keys(page: Path) -> set[str]:
    keys = set()
    for text in headings(page):
        keys.add(" ".join(text.split()))
        keys.add(" ".join(_FILE_LIST.sub("", text).split()))
    return keys


def slugs(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for text in headings(page):
        base = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def joined(path: Path) -> str:
    """The file's text with each citation on one line (rule 2)."""
    text = path.read_text(errors="replace")
    if path.suffix == ".py":
        text = re.sub(r"[\"'][ \t]*\n[ \t]*[rRbBfFuU]{0,2}[\"']", "", text)
    if path.suffix == ".md":
        text = re.sub(r"\n[ \t]*", " ", text)
    else:
        text = re.sub(r"\n[ \t]*(?:#[ \t]*)?", " ", text)
    return text.replace('\\"', '"')


def citations(root: Path) -> list[tuple[Path, str, str | None, str | None]]:
    """(file, page, quoted section or None, anchor or None) for every page path cited."""
    out = []
    for path in source_files(root):
        text = joined(path)
        for m in _PAGE.finditer(text):
            rest = text[m.end() :]
            section = _SECTION.match(rest)
            anchor = _ANCHOR.match(rest)
            out.append(
                (
                    path,
                    m.group(1),
                    " ".join(section.group(1).split()) if section else None,
                    anchor.group(1) if anchor else None,
                )
            )
    return out


def problems(root: Path) -> list[str]:
    found = []
    for path, page, section, anchor in citations(root):
        where = path.relative_to(root)
        target = root / "docs" / page
        if not target.is_file():
            found.append(f"{where}: docs/{page} does not exist")
        elif section is not None and section not in section_keys(target):
            found.append(f'{where}: docs/{page} has no section "{section}"')
        elif anchor is not None and anchor not in slugs(target):
            found.append(f"{where}: docs/{page} has no heading with the anchor #{anchor}")
    for path in source_files(root):
        if path.suffix != ".md":
            continue
        where = path.relative_to(root)
        body = _CODE_SPAN.sub("", "\n".join(_outside_fences(path.read_text())))
        for m in _LINK.finditer(body):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                found.append(f"{where}: link to {target}: {file_part} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in slugs(dest):
                found.append(f"{where}: link to {target}: no heading with that anchor")
    return found


def test_every_docs_citation_and_link_resolves():
    assert problems(ROOT) == []
    # Not vacuous: the code cites sections of several pages.
    cited = [c for c in citations(ROOT) if c[2] is not None]
    assert len(cited) >= 10 and len({c[1] for c in cited}) >= 4


def test_the_check_refuses_a_missing_page_section_or_anchor(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# A\n\n## Real part (`x.py`, `y.py`)\n\n```\n## Not a heading\n```\n"
    )
    (tmp_path / "src.py").write_text(
        '"""docs/a.md, "Real part" and `docs/a.md`, "Real\n    part"."""\n'
        '# docs/a.md ("Real part (`x.py`, `y.py`)") and docs/a.md "Real part"\n'
        'X = ("(docs/a.md, \\"Real "\n     "part\\")")\n'
        '# docs/a.md, "Missing part"\n'
        '# docs/a.md, "Not a heading"\n'
        "# docs/b.md\n"
    )
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md#real-part-xpy-ypy) [page](docs/a.md) [top](#title)\n"
        "[bad](docs/a.md#nope) [gone](docs/c.md)\n\n# Title\n"
    )
    assert sorted(problems(tmp_path)) == [
        "README.md: docs/a.md has no heading with the anchor #nope",
        "README.md: docs/c.md does not exist",
        "README.md: link to docs/a.md#nope: no heading with that anchor",
        "README.md: link to docs/c.md: docs/c.md does not exist",
        'src.py: docs/a.md has no section "Missing part"',
        'src.py: docs/a.md has no section "Not a heading"',
        "src.py: docs/b.md does not exist",
    ]
