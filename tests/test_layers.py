"""The package's layers run one way (docs/architecture.md): a module imports only from floors below
its own, lazy imports (inside functions) and ``TYPE_CHECKING`` imports included.

Also checked here, from the source alone: no module imports another module's ``_private`` name
or reads one off an imported module, no Python file under kvdb/ is much over 500 lines, and every
document or module the code and docs cite is in the repo (docs/style.md "Comments").
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "kvdb"

# floor -> the units on it (a unit is a top-level module or subpackage of kvdb); a unit may
# import units on lower floors only (and itself). Keep in step with docs/architecture.md.
FLOORS: list[set[str]] = [
    {"errors", "types", "threads", "_native", "compiled"},  # 0: leaves
    {"native", "sizes", "netns"},                      # 1: the C core's bindings, sizes, network namespaces
    {"fs"},                                            # 2: the file layer (native batched appends)
    {"format"},                                        # 3: bytes on disk and on the wire
    {"keys", "wal", "buffer_pool"},                    # 4: key spaces, the log, page frames
    {"cold", "planner", "metrics", "prompts"},         # 5: the cold tier, policies, prompt rendering
    {"db", "sim"},                                     # 6: the Db (pool + cold + plans); the simulator
    {"replication", "shared"},                         # 7: attach to a Db from above
    {"__init__"},                                      # 8: kvdb.open, the public API
    {"integrations"},                                  # 9: inside inference engines
    {"demo", "bench"},                                 # 10: examples and benchmarks (run engines)
    {"cli"},                                           # 11: the command line
]
FLOOR = {u: i for i, units in enumerate(FLOORS) for u in units}
MAX_LINES = 520  # "about 500"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "kvdb":
        return None
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def _is_submodule(name: str) -> bool:
    return (ROOT / f"{name}.py").exists() or (ROOT / name / "__init__.py").exists() or name == "_native"


def _imports(path: Path):
    """(line, imported module, names) for every import in the file, at any depth."""
    mod = _module_name(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
            if target == "kvdb":  # `from kvdb import native` imports the submodule
                for n in names:
                    yield node.lineno, f"kvdb.{n}" if _is_submodule(n) else "kvdb", [] if _is_submodule(n) else [n]
            else:
                yield node.lineno, target, names


FILES = sorted(ROOT.rglob("*.py"))


def test_every_unit_has_a_floor():
    units = {_unit(_module_name(f)) for f in FILES} | {"_native"}
    assert units - set(FLOOR) == set(), "add new packages to FLOORS (and docs/architecture.md)"


def test_imports_only_go_down():
    bad = []
    for f in FILES:
        src = _unit(_module_name(f))
        for line, target, _ in _imports(f):
            dst = _unit(target)
            if dst is None or dst == src:
                continue
            if FLOOR[dst] >= FLOOR[src]:
                bad.append(f"{f.relative_to(ROOT.parent)}:{line} ({src}, floor {FLOOR[src]}) imports {target} "
                           f"({dst}, floor {FLOOR[dst]})")
    assert not bad, "imports that run up or sideways:\n" + "\n".join(bad)


def test_no_module_takes_another_modules_private_names():
    bad = []
    for f in FILES:
        mod = _module_name(f)
        imported_modules: dict[str, str] = {}
        for line, target, names in _imports(f):
            if not target.startswith("kvdb"):
                continue
            for n in names:
                if n.startswith("_") and not n.startswith("__") and target != mod:
                    bad.append(f"{f.relative_to(ROOT.parent)}:{line} imports {target}.{n}")
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvdb"):
                for a in node.names:
                    if _is_submodule(a.name) or (ROOT / node.module.replace("kvdb.", "").replace(".", "/") / f"{a.name}.py").exists():
                        imported_modules[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("kvdb.") and a.asname:
                        imported_modules[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in imported_modules):
                bad.append(f"{f.relative_to(ROOT.parent)}:{node.lineno} reads "
                           f"{imported_modules[node.value.id]}.{node.attr}")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_no_file_is_much_over_500_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(ROOT.parent)} has {n} lines; split it by concept"


# ------------------------------------------------------------------ citations

REPO = ROOT.parent
CITED_PATH = re.compile(r"(?<![\w/.-])(docs/[\w./-]+?\.md|kvdb/[\w./-]+?\.py)(?!\w)")
MD_LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")
BARE_DOC = re.compile(r"(?<![\w/.-])([A-Z][A-Z_]*\.md)\b")  # an upper-case document name


def _cited(files):
    for f in files:
        for no, line in enumerate(f.read_text().splitlines(), start=1):
            yield f, no, line


def test_every_cited_doc_and_module_exists():
    """A ``docs/*.md`` or ``kvdb/*.py`` path cited in kvdb/, docs/ or the README, and every
    markdown link to a .md file there, names a file in the repo."""
    files = [*FILES, *sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
    bad = []
    for f, no, line in _cited(files):
        for m in CITED_PATH.finditer(line):
            if not (REPO / m.group(1)).exists():
                bad.append(f"{f.relative_to(REPO)}:{no} cites {m.group(1)}")
        if f.suffix == ".md":
            for m in MD_LINK.finditer(line):
                if "://" not in m.group(1) and not (f.parent / m.group(1)).exists():
                    bad.append(f"{f.relative_to(REPO)}:{no} links {m.group(1)}")
    assert not bad, "citations of files that are not in the repo:\n" + "\n".join(bad)


def test_no_citation_of_a_document_outside_the_repo():
    """A bare ``NAME.md`` (README.md, ...) cited in the code, tests, docs or tools is one at the
    repo's root: the project cites its own files only."""
    files = [*FILES, *sorted((REPO / "tests").rglob("*.py")), *sorted((REPO / "tools").rglob("*.py")),
             *sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
    bad = [f"{f.relative_to(REPO)}:{no} cites {m.group(1)}"
           for f, no, line in _cited(files) if f != Path(__file__).resolve()
           for m in BARE_DOC.finditer(line) if not (REPO / m.group(1)).exists()]
    assert not bad, "documents cited that the repo does not hold:\n" + "\n".join(bad)
