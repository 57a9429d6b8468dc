"""mkdocs hooks: README.md is the site's home page, and links out of docs/ are checked too.

The pages link as they read on GitHub: README.md to `docs/x.md`, a page to `../README.md#y`, to
plots in `../bench/results/` and to source files. mkdocs knows only the files under docs/, so
here README.md becomes `index.md`, every link is resolved from the file's own place in the
repository, and one that leaves docs/ must name an existing file: a plot is copied into the site,
a page of docs/ is linked as the site's page, and any other file (source, JSON) becomes its path
in code, since the site does not carry it. A link to nothing fails the build.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

REPO_ROOT = Path(__file__).resolve().parent.parent
SITE_ASSETS = (".png", ".svg", ".jpg")
# [text](target) and ![alt](target), not inside code spans; a target without spaces or a title.
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, "index.md", abs_src_path=str(REPO_ROOT / "README.md")))
    for plot in sorted((REPO_ROOT / "bench" / "results").rglob("*")):
        if plot.suffix in SITE_ASSETS:
            uri = plot.relative_to(REPO_ROOT).as_posix()
            files.append(File.generated(config, uri, abs_src_path=str(plot)))
    return files


def _repo_path(page: Page) -> Path:
    """Where the page's markdown lives in the repository."""
    return (
        REPO_ROOT / "README.md" if page.file.src_uri == "index.md" else REPO_ROOT / "docs" / page.file.src_uri
    )


def _site_uri(target: Path) -> str | None:
    """The site's uri for a repository file it carries, else None."""
    if target == REPO_ROOT / "README.md":
        return "index.md"
    docs = REPO_ROOT / "docs"
    if target.is_relative_to(docs):
        return target.relative_to(docs).as_posix()
    if target.suffix in SITE_ASSETS and target.is_relative_to(REPO_ROOT / "bench" / "results"):
        return target.relative_to(REPO_ROOT).as_posix()
    return None


def _rewrite(page: Page, match: re.Match[str]) -> str:
    bang, text, target = match.groups()
    if re.match(r"[a-z]+:", target) or target.startswith("#"):
        return match.group(0)  # a URL, or an anchor mkdocs checks itself
    path, _, anchor = target.partition("#")
    source = _repo_path(page)
    resolved = (source.parent / path).resolve()
    if not resolved.exists() or not resolved.is_relative_to(REPO_ROOT):
        raise PluginError(f"{source.relative_to(REPO_ROOT)}: a link to {target}, which does not exist")
    uri = _site_uri(resolved)
    if uri is None:
        return f"{text} (`{resolved.relative_to(REPO_ROOT).as_posix()}`)" if text else f"`{path}`"
    relative = posixpath.relpath(uri, posixpath.dirname(page.file.src_uri) or ".")
    return f"{bang}[{text}]({relative}{'#' + anchor if anchor else ''})"


def on_page_markdown(markdown: str, page: Page, config: Any, files: Files) -> str:
    # Code spans are set aside so that a link written inside one stays as written.
    spans: list[str] = []

    def keep(match: re.Match[str]) -> str:
        spans.append(match.group(0))
        return f"\x00{len(spans) - 1}\x00"

    text = CODE_SPAN.sub(keep, markdown)
    text = LINK.sub(lambda m: _rewrite(page, m), text)
    return re.sub(r"\x00(\d+)\x00", lambda m: spans[int(m.group(1))], text)
