"""The rooms' import order ([tool.importlinter] in pyproject.toml) holds, checked by import-linter, and the
check fails on an import that runs against it."""

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


def test_a_planted_back_edge_breaks_the_contract(tmp_path):
    """The model importing the CLI (a room far above it) is named as a broken layer."""
    shutil.copytree(REPO / "shard", tmp_path / "shard", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    llama = tmp_path / "shard" / "models" / "llama.py"
    llama.write_text(llama.read_text() + "\n\ndef _planted():\n    from shard.cli import app  # noqa: F401\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "shard.models is not allowed to import shard.cli" in result.stdout
    assert "shard.models.llama -> shard.cli.app" in result.stdout
