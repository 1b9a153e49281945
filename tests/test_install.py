"""install.sh with stand-in programs on PATH: it installs into a virtual environment (never with the system's
pip, which Debian and Ubuntu refuse: PEP 668), and it installs system packages only when told to."""
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# python3 as Debian's: `-m venv` makes an environment whose python logs its arguments; anything else is a
# use of the system's python that install.sh must not make. NO_ENSUREPIP: python3-venv is not installed.
PYTHON3 = """#!BASH
echo "python3 $*" >> "$LOG"
if [ "$1 $2" = "-m venv" ]; then
  if [ -n "${NO_ENSUREPIP:-}" ] && [[ " $* " != *" --without-pip "* ]]; then echo "no ensurepip" >&2; exit 1; fi
  dir="${@: -1}"; mkdir -p "$dir/bin"
  printf '#!BASH\\necho "venv-python $*" >> "$LOG"\\n[ "$1" = -c ] && exit 1\\nexit 0\\n' > "$dir/bin/python"
  chmod +x "$dir/bin/python"; exit 0
fi
exit 1
"""


def _install(tmp_path: Path, *args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, list[str]]:
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(REPO / "install.sh", repo / "install.sh")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    bash = shutil.which("bash")
    programs = {"python3": PYTHON3.replace("BASH", bash),
                "id": f"#!{bash}\necho 0\n",                       # root
                "apt-get": f'#!{bash}\necho "apt-get $*" >> "$LOG"\n'}
    for name, text in programs.items():
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(stat.S_IRWXU)
    for tool in ("dirname", "mkdir", "chmod"):
        os.symlink(shutil.which(tool), bin_ / tool)
    log = tmp_path / "log"
    log.touch()
    r = subprocess.run([bash, str(repo / "install.sh"), *args], stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=60, env={"PATH": str(bin_), "LOG": str(log), **(env or {})})
    return r, log.read_text().splitlines()


@pytest.mark.parametrize("how", ["asked", "--yes", "SHARD_INSTALL_YES", "no ensurepip"])
def test_install_uses_a_venv_and_asks_before_system_packages(tmp_path, how):
    args = ["--yes", "dev"] if how == "--yes" else ["dev"]
    env = {"SHARD_INSTALL_YES": "1"} if how == "SHARD_INSTALL_YES" else {}
    if how == "no ensurepip":
        env["NO_ENSUREPIP"] = "1"
    r, log = _install(tmp_path, *args, env=env)
    assert r.returncode == 0, r.stderr
    system = [line for line in log if line.startswith("python3")]
    assert all(line.startswith("python3 -m venv --system-site-packages") for line in system), log
    assert system[-1].endswith(".venv") and (tmp_path / "repo/.venv/bin/python").exists()
    assert "venv-python -m pip install -e .[dev]" in log
    told = how in ("--yes", "SHARD_INSTALL_YES")
    assert any(line.startswith("apt-get install") for line in log) == told, log
    if not told:
        assert "pass --yes or set SHARD_INSTALL_YES=1" in r.stderr
    assert "`. .venv/bin/activate` puts shard on PATH" in r.stderr


def test_install_without_extras_and_a_bad_option(tmp_path):
    r, log = _install(tmp_path)
    assert r.returncode == 0, r.stderr
    assert "venv-python -m pip install -e ." in log and not any("apt-get" in line for line in log)
    r = subprocess.run(["bash", str(tmp_path / "repo/install.sh"), "--force"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown option --force" in r.stderr
