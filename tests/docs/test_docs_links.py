"""The documentation stands on its own: every link and file reference in the
README and docs/ resolves inside the repository, nothing points at files a
user who clones the repository does not have, and every `docs/design.md §N`
citation in the code names a section that docs/design.md has.

Pure file reading: fast, no network.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DESIGN = REPO / "docs" / "design.md"
THIS_FILE = Path(__file__).resolve()

# Directories whose code and docs may cite docs/design.md.
CODE_DIRS = ("realrl", "training", "tests", "examples", "benchmarks", "scripts")
CODE_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt"}
SKIP_PARTS = {".venv", "__pycache__", ".git", ".pytest_cache", "build", "runs"}


def _doc_files() -> list[Path]:
    """README.md, every docs/**/*.md and every examples/**/README.md."""
    files = [REPO / "README.md"]
    files += sorted((REPO / "docs").rglob("*.md"))
    files += sorted((REPO / "examples").rglob("README.md"))
    return [f for f in files if f.is_file() and not SKIP_PARTS.intersection(f.relative_to(REPO).parts)]


def _code_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "pyproject.toml"]
    for d in CODE_DIRS:
        root = REPO / d
        if root.is_dir():
            files += sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in CODE_SUFFIXES)
    files += _doc_files()
    seen: set[Path] = set()
    out = []
    for f in files:
        f = f.resolve()
        if f in seen or f == THIS_FILE or not f.is_file():
            continue
        if SKIP_PARTS.intersection(f.relative_to(REPO).parts) or any(p.endswith(".egg-info") for p in f.parts):
            continue
        seen.add(f)
        out.append(f)
    return out


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


# ---- markdown parsing ---------------------------------------------------------------------

_FENCE = re.compile(r"^\s*(```|~~~)")
# [text](target) and ![alt](target); target up to the closing paren, optional "title".
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
# [label]: target   (reference definitions)
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# A path-like code span: relative, slash-separated, no placeholders or globs.
_PATHLIKE = re.compile(r"^[A-Za-z0-9_.\-]+(?:/[A-Za-z0-9_.\-]+)+/?$")
_FILE_SUFFIXES = (".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".txt")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def _links(text: str) -> list[tuple[int, str]]:
    links = []
    for n, line in _prose_lines(text):
        stripped = _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)  # `[a](b)` in code is no link
        for m in _INLINE_LINK.finditer(stripped):
            links.append((n, m.group(1).strip("<>")))
        m = _REF_DEF.match(stripped)
        if m:
            links.append((n, m.group(1).strip("<>")))
    return links


def _clone_top_level(repo: Path = REPO) -> set[str]:
    """The top-level names a fresh clone has: the tracked ones. What a user's runs
    left in the checkout (`runs/`, `.venv/`) does not make `runs/...` a repository path."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True)
    if listed.returncode != 0:  # not a git checkout (an unpacked archive): what is there
        return {p.name for p in repo.iterdir()}
    return {f.split("/")[0] for f in listed.stdout.decode().split("\0") if f}


def _git_ignored(path: Path, repo: Path = REPO) -> bool:
    """`path` is in a git-ignored place (by the patterns alone: it need not exist)."""
    return subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=repo, capture_output=True).returncode == 0


def _code_span_paths(text: str, repo: Path = REPO) -> list[tuple[int, str]]:
    """Code spans that name a file or directory of the repository, e.g.
    `realrl/api/trajectory.py` or `training/utils.py:place_gpus`. A span in a
    git-ignored place (`runs/checkpoints/...`, `benchmarks/results/x.json`) names
    what a run writes, not a file of the repository."""
    top_level = _clone_top_level(repo)
    refs = []
    for n, line in _prose_lines(text):
        for m in _CODE_SPAN.finditer(line):
            token = m.group(2).strip()
            if "://" in token:
                continue
            token = token.split("::")[0].split(":")[0]  # file.py:function, file.py::Class
            if not _PATHLIKE.match(token):
                continue
            first = token.split("/")[0]
            if first in top_level or first in (".", "..") or token.rstrip("/").endswith(_FILE_SUFFIXES):
                if first not in (".", "..") and _git_ignored(repo / token, repo):
                    continue
                refs.append((n, token))
    return refs


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip()).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    anchors: set[str] = set()
    counts: dict[str, int] = {}
    for _, line in _prose_lines(md.read_text(encoding="utf-8")):
        m = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = _slug(m.group(1))
            k = counts.get(slug, 0)
            counts[slug] = k + 1
            anchors.add(slug if k == 0 else f"{slug}-{k}")
    return anchors


def _inside_repo(path: Path, repo: Path = REPO) -> bool:
    try:
        path.resolve().relative_to(repo.resolve())
        return True
    except ValueError:
        return False


def _exists_in_clone(path: Path, repo: Path = REPO) -> bool:
    """Exists, and would exist in a fresh clone too (not a git-ignored output of
    some earlier run, e.g. benchmark results)."""
    return path.exists() and not _git_ignored(path, repo)


def _check_target(doc: Path, target: str) -> str | None:
    """An error message, or None if `target` is fine."""
    if re.match(r"^(https?|mailto):", target, re.I):
        return None
    if re.match(r"^[a-z][a-z0-9+.\-]*:", target, re.I):
        return f"unsupported link scheme in {target!r} (use a relative path or http(s))"
    path_part = target.split("#", 1)[0].split("?", 1)[0]
    anchor = target.split("#", 1)[1] if "#" in target else ""
    if not path_part:  # #anchor in the same file
        resolved = doc
    else:
        if path_part.startswith("/"):
            return f"absolute path {target!r}: link relative to the file instead"
        resolved = (doc.parent / path_part).resolve()
        if not _inside_repo(resolved):
            return f"{target!r} points outside the repository"
        if not _exists_in_clone(resolved):
            return f"{target!r} does not exist (resolved to {resolved})"
    if anchor and resolved.suffix == ".md" and resolved.is_file() and anchor not in _anchors(resolved):
        return f"{target!r}: no heading with anchor #{anchor} in {_rel(resolved)}"
    return None


# ---- the tests --------------------------------------------------------------------------------

DOCS = _doc_files()


def test_docs_found():
    names = {_rel(d) for d in DOCS}
    assert "README.md" in names and "docs/design.md" in names, names


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_markdown_links_resolve_inside_repo(doc: Path):
    errors = []
    for n, target in _links(doc.read_text(encoding="utf-8")):
        err = _check_target(doc, target)
        if err:
            errors.append(f"{_rel(doc)}:{n}: {err}")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_file_references_exist(doc: Path):
    """A code span naming a repository path must name one that exists,
    relative to the repository root (or to the file itself)."""
    errors = _missing_references(doc)
    assert not errors, "\n".join(errors)


def _missing_references(doc: Path, repo: Path = REPO) -> list[str]:
    errors = []
    for n, token in _code_span_paths(doc.read_text(encoding="utf-8"), repo):
        candidates = [repo / token, doc.parent / token]
        hits = [c for c in candidates if _inside_repo(c, repo) and _exists_in_clone(c, repo)]
        if not hits:
            errors.append(f"{doc.relative_to(repo)}:{n}: `{token}` does not exist in the repository")
    return errors


_FORBIDDEN = [
    (re.compile(r"\.\./shared\b"), "../shared (outside the repository)"),
    (re.compile(r"(?<![\w/])shared/DESIGN"), "shared/DESIGN (outside the repository)"),
    (re.compile(r"DESIGN\.md"), "DESIGN.md (the design page is docs/design.md)"),
]


@pytest.mark.parametrize("path", _code_files(), ids=_rel)
def test_no_references_outside_repo(path: Path):
    text = path.read_text(encoding="utf-8", errors="replace")
    forbidden = _FORBIDDEN + [(re.compile(re.escape(str(REPO)) + r"(?![\w\-])"), f"the absolute path {REPO}")]
    errors = []
    for n, line in enumerate(text.splitlines(), 1):
        for pattern, what in forbidden:
            if pattern.search(line):
                errors.append(f"{_rel(path)}:{n}: mentions {what}: {line.strip()[:120]}")
    assert not errors, "\n".join(errors)


# `docs/design.md §5`, `docs/design.md §5–§6`, `docs/design.md §2, §6-§8`
_CITATION = re.compile(r"docs/design\.md((?:\s*,?\s*§\s*\d+(?:\s*[-–—]\s*§?\s*\d+)?)+)")
_REF = re.compile(r"§\s*(\d+)(?:\s*[-–—]\s*§?\s*(\d+))?")


def _design_sections() -> dict[int, str]:
    sections = {}
    for _, line in _prose_lines(DESIGN.read_text(encoding="utf-8")):
        m = re.match(r"^## (\d+)\. (\S.*)$", line)
        if m:
            sections[int(m.group(1))] = m.group(2)
    return sections


def test_design_sections_numbered_in_order():
    numbers = list(_design_sections())
    assert numbers and numbers == list(range(1, len(numbers) + 1)), numbers


def _citations() -> list[tuple[str, int, int]]:
    out = []
    for path in _code_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            for m in _CITATION.finditer(line):
                for ref in _REF.finditer(m.group(1)):
                    lo = int(ref.group(1))
                    hi = int(ref.group(2)) if ref.group(2) else lo
                    for section in range(lo, max(lo, hi) + 1):
                        out.append((f"{_rel(path)}:{n}", section, hi))
    return out


def test_design_citations_name_existing_sections():
    sections = _design_sections()
    citations = _citations()
    assert citations, "found no docs/design.md §N citations at all: is the pattern still right?"
    errors = [
        f"{where}: cites docs/design.md §{section}, which has no '## {section}. ...' heading"
        for where, section, _ in citations
        if section not in sections
    ]
    errors += [f"{where}: backwards range ending at §{hi}" for where, section, hi in citations if hi < section]
    assert not errors, "\n".join(errors)


# ---- the checker itself --------------------------------------------------------------------


def test_checker_rejects_bad_targets(tmp_path):
    doc = REPO / "docs" / "design.md"
    assert _check_target(doc, "architecture.md") is None
    assert _check_target(doc, "architecture.md#recovery") is None
    assert _check_target(doc, "https://example.org/x") is None
    assert _check_target(doc, "#7-staleness") is None
    assert "outside" in _check_target(doc, "../../shared/DESIGN.md")
    assert "does not exist" in _check_target(doc, "no_such_page.md")
    assert "absolute" in _check_target(doc, "/etc/passwd")
    assert "anchor" in _check_target(doc, "architecture.md#no-such-heading")
    assert "scheme" in _check_target(doc, "file:///etc/passwd")
    text = 'see [a](x.md) and ![b](img/y.png "t") but not `[c](z.md)`\n```\n[d](w.md)\n```\n[e]: ../f.md\n'
    assert [t for _, t in _links(text)] == ["x.md", "img/y.png", "../f.md"]
    spans = "`realrl/api/trajectory.py` `training/utils.py:place_gpus` `model_version/actor` `<fileroot>/x` `/tmp/a.py`"
    assert [t for _, t in _code_span_paths(spans)] == ["realrl/api/trajectory.py", "training/utils.py"]
    cited = [
        int(x.group(1))
        for m in _CITATION.finditer("(docs/design.md §2, §6-§8) docs/design.md §5–§6")
        for x in _REF.finditer(m.group(1))
    ]
    assert cited == [2, 6, 5]


def test_file_references_do_not_depend_on_what_runs_left(tmp_path):
    """A user's runs leave `runs/` (ignored) in the checkout: the docs' `runs/...`
    spans stay outputs, not repository paths, whether or not it exists; a span to
    a tracked path still must exist."""
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / ".gitignore").write_text("/runs/\nbenchmarks/results/\n")
    (repo / "benchmarks").mkdir()
    (repo / "benchmarks" / "a.py").write_text("")
    doc = repo / "docs" / "page.md"
    doc.write_text(
        "checkpoints in `runs/checkpoints/...`, configs in `runs/logs/x/config.yaml`,\n"
        "results in `benchmarks/results/a.json`, the benchmark `benchmarks/a.py`\n"
    )
    for argv in (["init", "-q"], ["add", "-A"]):
        subprocess.run(["git", *argv], cwd=repo, check=True, capture_output=True)
    assert _missing_references(doc, repo) == []
    (repo / "runs" / "checkpoints").mkdir(parents=True)  # the demo ran
    (repo / "runs" / "logs" / "x").mkdir(parents=True)
    (repo / "benchmarks" / "results").mkdir()
    assert _missing_references(doc, repo) == []
    doc.write_text("the benchmark `benchmarks/b.py` and `runs/logs/x/config.yaml`\n")
    assert _missing_references(doc, repo) == ["docs/page.md:1: `benchmarks/b.py` does not exist in the repository"]
