"""The documentation stays true: its code runs, and the layering it describes holds.

* Every ```python block in README.md and docs/**/*.md is executed with ``exec`` in a fresh
  namespace (one test per block). A block whose first line is ``# doctest: skip`` is skipped.
  Blocks must therefore be self-contained and quick.
* ``test_the_site_builds`` builds the documentation site (mkdocs.yml) with ``--strict`` where
  mkdocs-material is installed (the ``docs`` extra; ``.ci/run`` installs it).
* ``test_layering`` parses every module under ``src/distsgd`` and checks that each package
  imports only itself and the packages below it (docs/architecture.md, section 1).
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import loadclock
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "distsgd"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

LAYERS = (
    "util",
    "cluster",
    "transport",
    "ps",
    "control",
    "plan",
    "schemes",
    "runtime",
    "workers",
    "api",
    "launcher",
    "cli",
)
"""The layers of distsgd, lowest first."""

TOP_LEVEL_EXEMPT = ("__init__.py", "__main__.py")
USER_SCRIPTS = ("demo",)
SEAMS = {
    "distsgd_emulate": "distsgd/launcher/emulated.py",
    "distsgd_rebalance": "distsgd/launcher/server_watch.py",
    "distsgd_compare": "distsgd/cli/main.py",
    "distsgd_k8s": "distsgd/cli/k8s.py",
}
"""The packages outside the core (emulate/distsgd_emulate; extras/distsgd_rebalance,
distsgd_compare and distsgd_k8s) sit above
distsgd; it imports each only in its seam, inside functions (tests/test_import_graph.py)."""
"""Packages that are user code: they may import only the top-level ``distsgd``."""

SKIP_MARKER = "# doctest: skip"


# --------------------------------------------------------------------------- python blocks


def _doc_files() -> list[Path]:
    files = [ROOT / "README.md"] if (ROOT / "README.md").is_file() else []
    docs = ROOT / "docs"
    if docs.is_dir():
        files += sorted(docs.rglob("*.md"))
    return files


def fenced_blocks(text: str, languages: tuple[str, ...]) -> Iterator[tuple[int, str, str]]:
    """(line number of the opening fence, language, code) for each fenced block in one of
    ``languages`` (lower case), its indentation (inside a list item) removed."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = lines[i].strip()
        language = opening[3:].strip().lower()
        if opening.startswith("```") and language in languages:
            indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
            body: list[str] = []
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                line = lines[j]
                body.append(line[len(indent) :] if line.startswith(indent) else line)
                j += 1
            if j == len(lines):
                raise ValueError(f"unclosed ```{language} block at line {i + 1}")
            yield i + 1, language, "\n".join(body) + "\n"
            i = j
        i += 1


def _python_blocks(text: str) -> Iterator[tuple[int, str]]:
    """(line number of the opening fence, code) for each ```python block."""
    for line, _, code in fenced_blocks(text, ("python",)):
        yield line, code


def _collect_blocks() -> list[pytest.param]:
    params = []
    for path in _doc_files():
        rel = path.relative_to(ROOT).as_posix()
        for index, (line, code) in enumerate(_python_blocks(path.read_text(encoding="utf-8"))):
            first = code.lstrip("\n").split("\n", 1)[0].strip()
            marks = [pytest.mark.skip(reason=SKIP_MARKER)] if first == SKIP_MARKER else []
            params.append(pytest.param(rel, line, code, id=f"{rel}-block{index}", marks=marks))
    return params


@pytest.fixture
def restore_scheme_registry() -> Iterator[None]:
    """Blocks may register example schemes; take them out again so other tests see the real
    catalogue (``distsgd.schemes.names()`` feeds CLI flags and parametrized tests)."""
    from distsgd.schemes import registry

    saved = dict(registry._SCHEMES)
    try:
        yield
    finally:
        registry._SCHEMES.clear()
        registry._SCHEMES.update(saved)


@pytest.mark.parametrize(("path", "line", "code"), _collect_blocks())
@pytest.mark.usefixtures("restore_scheme_registry")
def test_python_block_runs(path: str, line: int, code: str) -> None:
    # dont_inherit: the block must not pick up this file's `from __future__ import annotations`.
    compiled = compile(code, f"{path}:{line}", "exec", dont_inherit=True)
    # A real (temporary) module, so dataclasses and pickling can look the block up by name.
    module = types.ModuleType("distsgd_doc_block")
    module.__file__ = str(ROOT / path)
    sys.modules[module.__name__] = module
    try:
        exec(compiled, module.__dict__)
    finally:
        del sys.modules[module.__name__]


def _shell_commands(text: str) -> Iterator[tuple[int, list[str]]]:
    """(line, argv) of every ``distsgd ...`` command line in ```bash blocks."""
    import shlex

    inside, pending, start = False, "", 0
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("```"):
            inside = not inside and stripped[3:].strip().lower() in ("bash", "sh", "shell")
            continue
        if not inside:
            continue
        if not pending:
            start = number
        code = stripped if pending else stripped.split(" #", 1)[0].strip()
        if code.endswith("\\"):  # continued on the next line
            pending += code[:-1] + " "
            continue
        code, pending = pending + code, ""
        if code.endswith(" &"):  # started in the background
            code = code[:-2].rstrip()
        if code.startswith("distsgd "):
            yield start, shlex.split(code)[1:]


@pytest.mark.parametrize(
    "path", [p for p in _doc_files() if "distsgd " in p.read_text(encoding="utf-8")], ids=str
)
def test_shell_commands_in_docs_parse(path: Path) -> None:
    """Every ``distsgd`` command shown in a bash block is accepted by the CLI's parser, its
    scheme options belong to its scheme, and its scheme lists name real schemes."""
    from distsgd.cli.flags import scheme_options
    from distsgd.cli.parser import build_parser, parse_argv
    from distsgd.schemes.entries import parse_entry, split_schemes

    parser = build_parser()
    for line, argv in _shell_commands(path.read_text(encoding="utf-8")):
        where = f"{path.relative_to(ROOT)}:{line}: distsgd {' '.join(argv)}"
        try:
            with (
                contextlib.redirect_stdout(io.StringIO()),
                contextlib.redirect_stderr(io.StringIO()),
            ):
                args = parse_argv(parser, argv)
        except SystemExit as exc:  # --help-scheme prints and exits 0
            if exc.code in (0, None):
                continue
            raise AssertionError(f"{where} does not parse") from exc
        if getattr(args, "scheme", None) and args.command in ("run", "demo"):
            scheme_options(args)  # ValueError: an option of another scheme
        if args.command in ("compare", "plan"):
            for entry in split_schemes(args.schemes):
                parse_entry(entry)  # ValueError: an unknown scheme, option or value


def test_architecture_has_a_runnable_scheme_example() -> None:
    """The scheme example must stay executable (not skipped) and register a scheme."""
    blocks = [code for _, code in _python_blocks(ARCHITECTURE.read_text(encoding="utf-8"))]
    runnable = [code for code in blocks if not code.lstrip().startswith(SKIP_MARKER)]
    assert any("schemes.register(" in code and "Shard(" in code for code in runnable)


def test_block_extraction() -> None:
    text = (
        "intro\n```python\nx = 1\n```\n"
        "```text\nnot python\n```\n"
        "- item\n\n  ```python\n  # doctest: skip\n  y = 2\n  ```\n"
    )
    assert list(_python_blocks(text)) == [(2, "x = 1\n"), (10, "# doctest: skip\ny = 2\n")]


# --------------------------------------------------------------------------- doc <-> code


def test_architecture_names_the_layers_and_the_protocol() -> None:
    doc = ARCHITECTURE.read_text(encoding="utf-8")
    assert " -> ".join(LAYERS) in doc
    proto = (PACKAGE / "transport" / "proto" / "distsgd.proto").read_text(encoding="utf-8")
    rpcs = re.findall(r"^\s*rpc\s+(\w+)\s*\(", proto, flags=re.MULTILINE)
    codes = re.findall(r"^//\s{2,}([A-Z_]{5,})\s{2,}", proto, flags=re.MULTILINE)
    assert rpcs and codes
    for name in [*rpcs, *codes]:
        assert f"`{name}`" in doc, f"docs/architecture.md does not mention {name}"


def test_architecture_names_the_run_folder_files() -> None:
    from distsgd.control.folder import FINAL_PARAMS_FILE, METRICS_FILE, RESULT_FILE

    doc = ARCHITECTURE.read_text(encoding="utf-8")
    for name in (METRICS_FILE, RESULT_FILE, FINAL_PARAMS_FILE, "cluster.json", "tasks.json"):
        assert f"`{name}`" in doc, f"docs/architecture.md does not mention {name}"


# --------------------------------------------------------------------------- layering


def _layer_of(path: Path, package: Path = PACKAGE) -> str | None:
    """The package a module belongs to; None for the exempt top-level modules."""
    parts = path.relative_to(package).parts
    if len(parts) == 1:
        return None if parts[0] in TOP_LEVEL_EXEMPT else parts[0].removesuffix(".py")
    return parts[0]


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, package_dir: Path = PACKAGE) -> Iterator[tuple[int, str]]:
    """(line, imported distsgd module) for every import anywhere in the file, including
    function bodies, ``if TYPE_CHECKING:`` blocks and ``importlib.import_module("...")``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    module = _module_name(path, package_dir)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "distsgd":  # from distsgd import schemes / __version__
                for alias in node.names:
                    yield node.lineno, f"distsgd.{alias.name}"
            else:
                yield node.lineno, target
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (
                    isinstance(node.func, ast.Name)
                    and node.func.id in ("import_module", "__import__")
                )
            )
        ):
            yield node.lineno, node.args[0].value


def _target_layer(name: str) -> str | None:
    """The layer an imported name belongs to: a layer, "distsgd" for the top-level package
    (``import distsgd``, ``from distsgd import __version__``), or None if not distsgd."""
    parts = name.split(".")
    if parts[0] != "distsgd":
        return None
    if len(parts) == 1 or parts[1] not in {*LAYERS, *USER_SCRIPTS}:
        return "distsgd"
    return parts[1]


def _top_level_rank(package: Path = PACKAGE) -> int:
    """``distsgd/__init__.py`` imports some layers, so importing the top-level package is an
    import of the highest of them (today: api)."""
    ranks = [
        LAYERS.index(layer)
        for _, name in _imports(package / "__init__.py", package)
        if (layer := _target_layer(name)) in LAYERS
    ]
    return max(ranks, default=0)


def _violations(package: Path = PACKAGE) -> tuple[list[str], int]:
    """Upward imports as readable lines, and how many distsgd imports were checked."""
    problems: list[str] = []
    checked = 0
    top_rank = _top_level_rank(package)
    for path in sorted(package.rglob("*.py")):
        layer = _layer_of(path, package)
        if layer is None:
            continue
        rel = path.relative_to(package.parent).as_posix()
        if layer not in LAYERS and layer not in USER_SCRIPTS:
            problems.append(f"{rel}: package {layer!r} is not in the layer order {LAYERS}")
            continue
        for line, name in _imports(path, package):
            if (seam := SEAMS.get(name.split(".")[0])) is not None:
                checked += 1
                if rel != seam:
                    problems.append(f"{rel}:{line}: {layer} imports {name} (only {seam} may)")
                continue
            target = _target_layer(name)
            if target is None:
                continue
            checked += 1
            where = f"{rel}:{line}: {layer} imports {name}"
            if layer in USER_SCRIPTS:
                if target not in ("distsgd", layer):  # its own models (demo.gpt) too
                    problems.append(f"{where} (a user script may import only `distsgd`)")
                continue
            if target in USER_SCRIPTS:
                problems.append(f"{where} (nothing may import the demo)")
                continue
            rank = top_rank if target == "distsgd" else LAYERS.index(target)
            if rank > LAYERS.index(layer):
                shown = (
                    f"distsgd (which imports {LAYERS[top_rank]})" if target == "distsgd" else target
                )
                problems.append(f"{where}: {shown} is above {layer}")
    return problems, checked


def test_layering() -> None:
    problems, checked = _violations()
    assert checked > 50, f"only {checked} distsgd imports found; is the parser broken?"
    assert not problems, "upward imports (see docs/architecture.md, section 1):\n" + "\n".join(
        problems
    )


def test_layering_parser_sees_every_kind_of_import() -> None:
    """The checker itself: relative, TYPE_CHECKING, in-function, top-level-package imports."""
    module = PACKAGE / "runtime" / "context.py"
    seen = {name for _, name in _imports(module)}
    assert "distsgd.ps.client" in seen
    scheme = {name for _, name in _imports(PACKAGE / "runtime" / "scheme.py")}
    assert "distsgd.runtime.context" in scheme  # under `if TYPE_CHECKING:`
    cluster = {name for _, name in _imports(PACKAGE / "cluster" / "__init__.py")}
    assert "distsgd.cluster.spec" in cluster  # `from .spec import ...`
    cli = {name for f in ("main.py", "parser.py") for _, name in _imports(PACKAGE / "cli" / f)}
    assert {"distsgd.launcher", "distsgd.schemes", "distsgd.__version__"} <= cli
    assert _target_layer("distsgd.__version__") == "distsgd"
    assert _target_layer("distsgd.schemes.sync") == "schemes"
    assert _target_layer("numpy") is None
    assert LAYERS[_top_level_rank()] == "api"


def test_layering_checker_reports_upward_imports(tmp_path: Path) -> None:
    """A made-up package tree with one violation of each kind, and allowed imports."""
    files = {
        "__init__.py": "from distsgd.api import train\n",
        "util/__init__.py": "",
        "cluster/__init__.py": "from .spec import ClusterSpec\n",  # allowed: itself
        "cluster/spec.py": "import distsgd.util\n",  # allowed: below
        "ps/shard.py": "from distsgd.ps.rules import UpdateRule\n",
        "ps/rules.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from distsgd.runtime.context import WorkerContext\n"  # upward, type-only
        ),
        "runtime/loop.py": (
            "def f():\n"
            "    from distsgd import workers\n"  # upward, inside a function
            "    import distsgd\n"  # the top-level package is the api layer
        ),
        "cli/main.py": "from distsgd import __version__\nfrom distsgd.launcher import launch\n",
        "demo/digits.py": "import distsgd\nfrom distsgd.runtime import TrainConfig\n",
        "extras/x.py": "",
    }
    package = tmp_path / "distsgd"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    problems, checked = _violations(package)
    text = "\n".join(problems)
    assert "ps/rules.py:3: ps imports distsgd.runtime.context" in text
    assert "runtime/loop.py:2: runtime imports distsgd.workers" in text
    assert "runtime/loop.py:3: runtime imports distsgd: distsgd (which imports api)" in text
    assert "demo/digits.py:2: demo imports distsgd.runtime" in text
    assert "package 'extras' is not in the layer order" in text
    assert len(problems) == 5, text
    assert checked == 10


def _anchors(text: str) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def test_relative_links_in_docs_resolve() -> None:
    """Every relative link (and #anchor) in README.md and docs/ points at something that exists."""
    broken = []
    for path in _doc_files():
        text = path.read_text(encoding="utf-8")
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(#[^)\s]*)?\)", prose):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            resolved = (path.parent / target) if target else path
            if not resolved.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
            elif (
                anchor
                and resolved.suffix == ".md"
                and anchor[1:] not in _anchors(resolved.read_text(encoding="utf-8"))
            ):
                broken.append(f"{path.relative_to(ROOT)}: {target}{anchor}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_site_builds(tmp_path: Path) -> None:
    """``mkdocs build --strict``: every page in the nav, no broken link or anchor, the README as
    the home page with its links into docs/ made relative."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    site = tmp_path / "site"
    done = loadclock.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    home = (site / "index.html").read_text(encoding="utf-8")
    assert 'href="architecture/"' in home and 'href="docs/' not in home
    for path in (ROOT / "docs").rglob("*.md"):
        page = path.relative_to(ROOT / "docs").with_suffix("")
        page = page.parent if page.name in ("README", "index") else page
        assert (site / page / "index.html").is_file(), f"{path} is not on the site"


def test_every_docs_page_is_in_the_sites_navigation() -> None:
    """A page outside ``nav`` is one a reader of the site never finds (issue 39)."""
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8").split("\nnav:", 1)[1]
    listed = set(re.findall(r":\s*([\w./-]+\.md)\s*$", nav, flags=re.MULTILINE))
    docs = ROOT / "docs"
    pages = {str(p.relative_to(docs)) for p in docs.rglob("*.md")}
    assert sorted(pages - listed) == []
    assert sorted(listed - pages - {"index.md"}) == []  # index.md: the README (site hook)


README_MAX_LINES = 150
README_MAX_FLAGS = 15


def test_the_readme_is_a_front_door() -> None:
    """README.md is one page (issue 39): at most 150 lines and 15 distinct ``--flags`` named
    anywhere in it (prose, code and the test command alike); the rest lives in docs/."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    flags = sorted(set(re.findall(r"--[a-z][a-z0-9-]+", text)))
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move some to docs/"
    assert len(flags) <= README_MAX_FLAGS, f"README.md names {len(flags)} flags: {flags}"
