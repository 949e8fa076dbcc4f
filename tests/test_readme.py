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
    # the engine's line once, as the run starts (report() printed it again)
    engine = [line for line in proc.stdout.splitlines() if line.startswith("tpu_utility: engine")]
    assert len(engine) == 1, proc.stdout
    # the README shows what it prints, but the times
    shown = readme[readme.index("```text\n", start) + len("```text\n"):]
    shown = shown[:shown.index("```")].splitlines()
    printed = proc.stdout.splitlines()
    assert [line.split()[0] for line in shown] == [line.split()[0] for line in printed], \
        (shown, printed)
    assert len(proc.stderr.splitlines()) <= 2, proc.stderr


def readme_table(heading: str) -> list:
    """The rows (cells split) of the table under the README's `### heading`."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index(f"### {heading}")
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows or line.startswith("#"):
            break
    return rows[2:]


def test_the_errors_table_names_every_exported_exception():
    import tpu_utility
    exported = {name for name in tpu_utility.__all__
                if isinstance(getattr(tpu_utility, name), type)
                and issubclass(getattr(tpu_utility, name), BaseException)}
    named = {name for row in readme_table("Errors") for name in re.findall(r"`(\w+)`", row[0])}
    assert exported and exported <= named, exported - named
    for row in readme_table("Errors"):  # each row says when and what to do
        assert len(row) == 3 and all(len(cell) > 10 for cell in row[1:]), row


def test_the_switches_table_names_every_variable_the_code_reads():
    read = set()
    for path in PACKAGE.rglob("*.py"):
        read |= set(re.findall(r"TPU_UTILITY_[A-Z_]+", path.read_text()))
    named = {name for row in readme_table("Switches") for name in re.findall(r"TPU_UTILITY_[A-Z_]+", row[0])}
    assert len(read) >= 5 and read == named, (read - named, named - read)
    from tpu_utility.engines import REGISTRY
    engines = next(row for row in readme_table("Switches") if "engine=" in row[0])
    assert set(re.findall(r'`"(\w+)"`', engines[1])) == set(REGISTRY), engines


def test_every_link_into_measured_md_names_a_heading():
    slugs = set()
    for line in (ROOT / "docs" / "measured.md").read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            slugs.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    links = [(path.name, anchor) for path in PACKAGE.rglob("*.py")
             for anchor in re.findall(r"measured\.md#([\w\-]+)", path.read_text())]
    assert len(links) >= 4 and [link for link in links if link[1] not in slugs] == []


def test_docstrings_keep_behaviour_and_leave_measured_figures_to_measured_md():
    import ast
    figure = re.compile(r"\b\d+(\.\d+)?(-\d+(\.\d+)?)?x\b(?! (its|the) minim)|\b\d+(\.\d+)? ?ms\b")
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = (ast.get_docstring(node, clean=False) or "").split("Example")[0]
                found += [f"{path.name}: {m.group(0)}" for m in figure.finditer(doc)]
    assert found == [], found
