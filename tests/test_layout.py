"""The house rules that keep the rooms apart: what each package may import, where Ray may
be imported, where environment variables may be read, and how large a module may grow."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.builders import REPO

PRODUCTION = ("pipeline", "actors", "profiling")
CORE_ROOMS = ("pipeline.model", "pipeline.decoding", "pipeline.knapspec")
# The summarization room's Ray Data modules: its datasource, its map_batches stage and its sink.
RAY_IN_PIPELINE = {
    "pipeline/summarization/datasource.py",
    "pipeline/summarization/dispatch.py",
    "pipeline/summarization/output_nodes.py",
    "pipeline/summarization/sink.py",
    "pipeline/summarization/stage.py",
}
MAX_MODULE_LINES = 420  # "a few hundred lines at most", with a little slack
# What each room may import from the others, as its __init__.py says (errors, logs and locks are shared by all).
SHARED = {"errors", "logs", "locks"}
ALLOWED = {
    "model": set(),
    "decoding": {"model"},
    "knapspec": {"model", "decoding"},
    "parallel": {"model", "decoding", "knapspec"},
    "summarization": {"model", "decoding", "knapspec", "parallel", "engine"},
}


def modules(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (REPO / package).rglob("*.py"))


def imported(path: Path, depth: int = 1) -> set[str]:
    """Top-level names of everything `path` imports when it runs, function-local imports
    included (not those for type checkers only)."""
    names = set()
    pending = [ast.parse(path.read_text(), str(path))]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            pending.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            names.update(".".join(alias.name.split(".")[:depth]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(".".join(node.module.split(".")[:depth]))
        pending.extend(ast.iter_child_nodes(node))
    return names


def test_pipeline_imports_nothing_from_actors_jobs_or_profiling():
    offenders = {
        str(p.relative_to(REPO)): sorted(imported(p) & {"actors", "jobs", "profiling"}) for p in modules("pipeline")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_rooms_import_only_the_rooms_below_them(room):
    reached = set()
    for path in modules(f"pipeline/{room}"):
        reached |= {name.split(".")[1] for name in imported(path, depth=2) if name.startswith("pipeline.")}
    assert reached - {room} - SHARED <= ALLOWED[room]


def test_ray_only_in_the_ray_data_modules():
    with_ray = {str(p.relative_to(REPO)) for p in modules("pipeline") if "ray" in imported(p)}
    assert with_ray == RAY_IN_PIPELINE


def test_core_rooms_import_without_ray():
    code = (
        "import importlib, pkgutil, sys\n"
        f"for room in {CORE_ROOMS!r}:\n"
        "    package = importlib.import_module(room)\n"
        "    for info in pkgutil.walk_packages(package.__path__, room + '.'):\n"
        "        importlib.import_module(info.name)\n"
        "loaded = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
        "assert not loaded, loaded\n"
        "assert not any(m.split('.')[0] in ('actors', 'profiling') for m in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_no_production_module_reads_the_environment():
    """Settings come in through config objects built at the jobs' boundary, and test
    support stays in tests/: nothing below jobs/ reads an environment variable."""
    readers = []
    for path in modules(*PRODUCTION):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                if isinstance(node.value, ast.Name) and node.value.id == "os":
                    readers.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert readers == []


@pytest.mark.parametrize("package", (*PRODUCTION, "jobs"))
def test_modules_stay_small(package):
    """The jobs too: a job is a short driver over the modules that do its work."""
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in modules(package)}
    assert {k: n for k, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def test_no_module_imports_itself_round_a_circle():
    """No import circle between modules, counting imports for type checkers and inside
    functions: a circle means two modules that are one concern, or one reaching up."""
    names = {
        ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p for p in modules(*PRODUCTION)
    }
    graph = {}
    for name, path in names.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                edges.add(node.module)
                edges.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = {e for e in edges if e in names and e != name}
    circles = [sorted(c) for c in _strongly_connected(graph) if len(c) > 1]
    assert circles == []


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components of a directed graph."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            found.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return found


# What a literal getattr/hasattr may probe: the object's own fields (self, cls), what comes
# from outside the house (argparse namespaces, Hugging Face configs, libraries' modules), and
# a thread-local of the object's own.
PROBED_FREELY = {
    "self",
    "cls",
    "other",
    "args",
    "config",
    "hf_config",
    "torch",
    "torch.ops.quantized",
    "torch.ops.aten",
    "pa.types",
    "backend",
    "self._live",
}


def test_no_getattr_reaches_into_another_rooms_objects():
    """An optional attribute fished out of another object (`getattr(drafter, "planner", None)`)
    is an interface nobody wrote down: what one room needs of another's objects is a protocol
    member, called as such. Dispatch by a method name held in a variable (links, actors) is
    not probing."""
    probes = []
    for path in modules(*PRODUCTION, "jobs"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id not in ("getattr", "hasattr") or len(node.args) < 2:
                continue
            if isinstance(node.args[1], ast.Constant) and ast.unparse(node.args[0]) not in PROBED_FREELY:
                probes.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert probes == []
