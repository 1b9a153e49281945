"""The public API: every name shard/__init__.py lists resolves, and `import shard` loads no JAX (the CLI
sets the simulated device count after it); nor do the CLI's modules and what `shard plan` reads."""

import subprocess
import sys

import shard


def test_import_shard_loads_no_jax_and_every_listed_name_resolves():
    code = ("import sys, shard, shard.config, shard.cli.app, shard.measure.plan, shard.measure.hlo\n"
            "assert 'jax' not in sys.modules, 'importing them loaded jax'\n"
            "missing = [n for n in shard.__all__ if getattr(shard, n, None) is None]\n"
            "assert not missing, missing\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_the_public_names_are_the_library_objects():
    from shard.config.resolve import resolve
    from shard.training.loop import train

    assert shard.train is train and shard.config.resolve is resolve
    assert set(shard.__all__) <= set(dir(shard))
    try:
        shard.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no attribute 'no_such_name'" in str(e)
    else:
        raise AssertionError("an unknown name resolved")


# The packages whose API is listed (`__all__`): shard itself and the rooms a program may import from.
LISTED = ("shard", "shard.config", "shard.run", "shard.measure", "shard.observe", "shard.data", "shard.cluster",
          "shard.training", "shard.testing", "shard.axes")


def _code_of_docs() -> list[tuple[str, str]]:
    """(where, code) of every Python block of README.md and docs/, and every code cell of colabs/."""
    import json
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    code = [(str(md.relative_to(root)), block) for md in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
            for block in re.findall(r"```python\n(.*?)```", md.read_text(), flags=re.S)]
    for nb in sorted((root / "colabs").glob("*.ipynb")):
        code += [(str(nb.relative_to(root)), "".join(cell["source"])) for cell in json.loads(nb.read_text())["cells"]
                 if cell["cell_type"] == "code"]
    return code


def _shard_imports(code: str) -> list[tuple[str, list[str]]]:
    """(module, names) of each import of shard's in `code`, and in the code its strings hold (a script a
    notebook writes); names is [] for `import shard.x`."""
    import ast
    import contextlib

    found = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "shard":
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.split(".")[0] == "shard"]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "shard" in node.value:
            with contextlib.suppress(SyntaxError):  # a string that is not code
                found += _shard_imports(node.value)
    return found


def test_the_docs_and_notebooks_import_only_the_listed_api():
    """What docs/, the README and colabs/ teach is the public API: each import is from shard or a listed
    subpackage, and each name it takes is in that package's __all__."""
    import importlib

    problems = []
    for where, code in _code_of_docs():
        for module, names in _shard_imports(code):
            if module not in LISTED:
                problems.append(f"{where}: {module} is not a listed API")
                continue
            api = importlib.import_module(module).__all__
            problems += [f"{where}: {module}.{name} is not in its __all__" for name in names if name not in api]
    assert not problems, "\n".join(problems)
