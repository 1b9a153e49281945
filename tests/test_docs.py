"""Docs that are programs: docs/library.md's Python blocks, run top to bottom as one script."""

import re
import subprocess
import sys
from pathlib import Path

from shard.testing import subprocess_env, xla_flags_for_tests

DOCS = Path(__file__).parents[1] / "docs"


def python_blocks(markdown: str) -> str:
    return "\n".join(re.findall(r"```python\n(.*?)```", markdown, flags=re.S))


def test_the_library_page_runs_as_written(tmp_path):
    script = python_blocks((DOCS / "library.md").read_text())
    assert script.count("\n") > 50  # the blocks were found
    (tmp_path / "library.py").write_text(script)
    # the page measures a compiled step against the cost model: XLA:CPU's fusion emitters on, as users
    # compile (without them tensor parallel moved less than its minimum, which `efficiency` raises)
    env = subprocess_env(8, XLA_FLAGS=xla_flags_for_tests(8) + " --xla_cpu_use_fusion_emitters=true")
    done = subprocess.run([sys.executable, "library.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.splitlines()
    assert out[0].endswith("(None, 'fsdp', 'model')"), out  # w_up on fsdp=2,model=4
    assert float(out[1].split("'loss': ")[1].split(",")[0]) < 3.5, out  # from ln(256) = 5.5
    assert out[2].startswith("20 ") and out[2].endswith("(None, None, 'model', None)"), out  # wq restored onto 2x4


def test_the_kubernetes_example_is_a_jobset_whose_workers_resume_on_a_mesh_with_a_fill_axis():
    """docs/cluster.md's manifest parses (syntax only: no cluster here) and keeps what makes it elastic."""
    import yaml

    blocks = re.findall(r"```yaml\n(.*?)```", (DOCS / "cluster.md").read_text(), flags=re.S)
    assert len(blocks) == 1
    doc = yaml.safe_load(blocks[0])
    assert (doc["apiVersion"], doc["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    job = doc["spec"]["replicatedJobs"][0]["template"]["spec"]
    command = " ".join(job["template"]["spec"]["containers"][0]["args"])
    assert "--resume --allow-fresh" in command and "--mesh data=-1," in command
    assert job["completionMode"] == "Indexed" and "$JOB_COMPLETION_INDEX" in command


def test_the_readme_counts_the_notebooks_and_every_page_installs_one_way():
    """The README said four notebooks when colabs/ held five; pages said `pip install 'shard[eval]'` beside
    the README's `./install.sh EXTRAS` (which also builds what pip cannot)."""
    import tomllib
    root = DOCS.parent
    count = len(list((root / "colabs").glob("*.ipynb")))
    word = ["no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"][count]
    assert f"`colabs/` holds {word} notebooks" in (root / "README.md").read_text()
    for page in [root / "README.md", *DOCS.glob("*.md")]:
        assert not re.search(r"pip install ['\"]?shard\[", page.read_text()), page
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("ipywidgets") for d in extras["notebooks"])  # the notebooks' progress bars
