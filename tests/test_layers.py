"""The rooms' import order ([tool.importlinter] in pyproject.toml) holds, checked by import-linter, and the
check fails on an import that runs against it; no module takes part in an import cycle, inside a room
either, and that check finds a loop planted in a copy of the package."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter on the package under `root`, with the repository's contracts."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True))")
    return subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PATH": "", "PYTHONPATH": str(root)})


def test_the_package_keeps_its_layers():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


def lint_with_planted_import(tmp_path: Path, module: str, statement: str) -> subprocess.CompletedProcess:
    """import-linter on a copy of the package whose `module` (a path under shard/) gained a function
    holding `statement`."""
    shutil.copytree(REPO / "shard", tmp_path / "shard", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    planted = tmp_path / "shard" / module
    planted.write_text(planted.read_text() + f"\n\ndef _planted():\n    {statement}  # noqa: F401\n")
    return lint_imports(tmp_path)


def test_a_planted_back_edge_breaks_the_contract(tmp_path):
    """The model importing the CLI (a room far above it) is named as a broken layer."""
    result = lint_with_planted_import(tmp_path, "models/llama.py", "from shard.cli import app")
    assert result.returncode != 0
    assert "shard.models is not allowed to import shard.cli" in result.stdout
    assert "shard.models.llama -> shard.cli.app" in result.stdout


def test_a_command_that_reaches_past_the_front_breaks_the_contract(tmp_path):
    """A command importing the training room itself, not through the library's front (shard, config, run,
    measure, observe, data), is named as a forbidden import."""
    result = lint_with_planted_import(tmp_path, "cli/plan.py", "from shard.training import loop")
    assert result.returncode != 0
    assert "the command line imports the library's front BROKEN" in result.stdout
    assert "shard.cli is not allowed to import shard.training" in result.stdout
    assert "shard.cli.plan -> shard.training.loop" in result.stdout


def import_graph(root: Path) -> dict[str, set[str]]:
    """The modules of the package under `root`, each with the package's modules it imports, by grimp (the
    graph import-linter reads): imports inside functions and under TYPE_CHECKING count."""
    code = ("import json, grimp; graph = grimp.build_graph('shard', cache_dir=None); "
            "print(json.dumps({m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}))")
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                            env={"PATH": "", "PYTHONPATH": str(root)})
    assert result.returncode == 0, result.stderr
    return {module: set(imported) for module, imported in json.loads(result.stdout).items()}


def import_cycles(root: Path) -> list[str]:
    """Every import cycle among the modules of the package under `root`, one line each: the modules that
    import each other round a loop (a strongly connected group of two or more), then one shortest loop
    through them, e.g. `shard.a, shard.b: shard.a -> shard.b -> shard.a`."""
    graph = import_graph(root)
    return [f"{', '.join(group)}: {' -> '.join(_shortest_loop(graph, group))}"
            for group in _strongly_connected_groups(graph)]


def _strongly_connected_groups(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of two or more modules (Tarjan's algorithm), each sorted, in order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups)


def _shortest_loop(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """A shortest loop from the group's first module back to it, through the group (breadth first)."""
    start, members = group[0], set(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while start not in came_from:
        step = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w not in came_from:
                    came_from[w] = v
                    step.append(w)
        frontier = step
    loop = [start]
    while len(loop) == 1 or loop[-1] != start:
        loop.append(came_from[loop[-1]])
    return loop[::-1]


def test_no_module_takes_part_in_an_import_cycle():
    cycles = import_cycles(REPO)
    assert not cycles, "import cycles among shard's modules (imports inside functions count):\n" + "\n".join(
        cycles)


def test_a_planted_import_loop_is_found(tmp_path):
    """Two leaves importing each other, one of them inside a function, are named as a cycle."""
    shutil.copytree(REPO / "shard", tmp_path / "shard", ignore=shutil.ignore_patterns("__pycache__"))
    axes, errors = tmp_path / "shard" / "axes.py", tmp_path / "shard" / "errors.py"
    axes.write_text(axes.read_text() + "\nfrom shard import errors  # noqa: E402, F401\n")
    errors.write_text(errors.read_text() + "\n\ndef _planted():\n    from shard.axes import BATCH  # noqa: F401\n")
    assert "shard.axes, shard.errors: shard.axes -> shard.errors -> shard.axes" in import_cycles(tmp_path)
