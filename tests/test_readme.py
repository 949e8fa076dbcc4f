"""The README as a newcomer reads it: its module map ("Where things are") names every module
of the package, and its quick start runs as written."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tpu_utility"


def module_map() -> set:
    """The names in the first column of the table after "Where things are": `x.py`, `x/`, `x/y.py`."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Where things are"))
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("|"):
            rows.append(line)
        elif rows:  # the table has ended
            break
    assert rows[0].startswith("| file |") and set(rows[1]) <= set("|- ")  # header, rule
    return {name for row in rows[2:] for name in re.findall(r"`([^`]+)`", row.split("|")[1])}


def test_the_module_map_names_every_module():
    named = module_map()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.name in ("__init__.py", "__main__.py") or "__pycache__" in rel.parts:
            continue
        folders = {"/".join(rel.parts[:i]) + "/" for i in range(1, len(rel.parts))}
        if rel.as_posix() not in named and not folders & named:  # the file, or a folder above it
            missing.append(rel.as_posix())
    assert missing == [], f"README.md's module map has no row for {missing}"
    for name in named:  # and names nothing that is gone
        assert (PACKAGE / name.rstrip("/")).exists(), name


def test_the_quick_start_runs_as_written(run_script):
    """The README's quick start, copied from the README as a user copies it, run as a
    script (spawned replicas on 8 virtual devices): it trains, and says nothing amiss."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Quick start")
    code = readme[readme.index("```python\n", start) + len("```python\n"):]
    code = code[:code.index("```")]
    proc = run_script(code, timeout=240)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("valid accuracy per epoch:"))
    accuracy = [float(x) for x in line.split(":", 1)[1].strip(" []").split(",")]
    assert len(accuracy) == 3 and accuracy[-1] > 0.95, proc.stdout
    assert "hint:" not in proc.stdout, proc.stdout  # a healthy run gets no advice
    assert len(proc.stderr.splitlines()) <= 2, proc.stderr
