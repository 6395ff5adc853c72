"""MkDocs hook (mkdocs.yml `hooks:`): links from a docs page to a file of the repository outside docs/ (the
Dockerfile, a compose file, a dashboard) are not pages of the site. Each one is checked to exist — a missing one fails
the build, as a broken link between pages does under `strict: true` — and rendered as a link into the repository when
mkdocs.yml sets `repo_url`, else as the path in code."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.exceptions import PluginError

LINK = re.compile(r"\[([^\]]+)\]\((\.\./[^)\s#]+)(#[^)\s]*)?\)")


def on_page_markdown(markdown, page, config, files):
    docs = Path(config["docs_dir"]).resolve()
    root = docs.parent
    page_dir = (docs / page.file.src_uri).parent

    def outside(m: re.Match) -> str:
        text, target, anchor = m.group(1), m.group(2), m.group(3) or ""
        path = (page_dir / target).resolve()
        if path.is_relative_to(docs):
            return m.group(0)  # a page or file of the site: MkDocs validates it
        if not path.exists():
            raise PluginError(f"{page.file.src_uri} links to {target}, which does not exist")
        rel = posixpath.join(*path.relative_to(root).parts)
        if config.get("repo_url"):
            return f"[{text}]({config['repo_url'].rstrip('/')}/blob/HEAD/{rel}{anchor})"
        return text if Path(rel).name in text else f"{text} (`{rel}`)"

    return LINK.sub(outside, markdown)
