"""Notebooks, and the import line for scripts.

A notebook that trains at its top level is wrapped as a script is: its code cells are
ported as one script, and from the first cell that touches the device or trains, the
code becomes `train_fn`, run by `tu.run(train_fn, cores=8)` from a last cell; no
`tu.get_device()` is left at the top, where it would start XLA in the kernel and stop
`run`. Any other notebook is ported cell by cell (an optimizer made in one cell is
stepped in another). The first code cell gets `import tpu_utility as tu`."""
from __future__ import annotations

import ast
import json
import re
from typing import List, Optional

from .edits import split_lines
from .magics import mask_magics
from .pipeline import PortResult, port_source
from .rules.structure import WRAP


def add_import(text: str) -> str:
    """`import tpu_utility as tu` after the last top-level import, if it is used and absent."""
    if "tu." not in text or re.search(r"^import tpu_utility as tu$", text, re.M):
        return text
    tree = ast.parse(mask_magics(text))
    imports = [s for s in tree.body if isinstance(s, (ast.Import, ast.ImportFrom))]
    lines = split_lines(text)
    at = imports[-1].end_lineno if imports else 0
    lines.insert(at, "import tpu_utility as tu\n")
    return "".join(lines)


def code_lines(text: str, path: str) -> List[str]:
    """The lines a diff shows: a script's, or a notebook's code cells under `# cell N`."""
    if not path.endswith(".ipynb"):
        return text.splitlines(keepends=True)
    lines = []
    for n, cell in enumerate(json.loads(text).get("cells", []), 1):
        if cell.get("cell_type") == "code":
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            lines += [f"# cell {n}\n"] + [line.rstrip("\n") + "\n" for line in source.splitlines()]
    return lines


_MARK = "# tpu_utility: cell "


def _cell_source(cell) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _wrapped(notebook) -> Optional[PortResult]:
    """The notebook with its top-level training wrapped, or None if it has none."""
    cells = notebook.get("cells", [])
    code = [n for n, cell in enumerate(cells) if cell.get("cell_type") == "code"]
    joined, where = [], []  # where: per joined line, (cell number from 1, its line in it)
    for n in code:
        text = _cell_source(cells[n])
        joined.append(f"{_MARK}{n + 1}\n")
        where.append((n + 1, 0))
        lines = split_lines(text) or ["\n"]
        lines[-1] = lines[-1] if lines[-1].endswith("\n") else lines[-1] + "\n"
        joined += lines
        where += [(n + 1, i) for i in range(1, len(lines) + 1)]
    result = port_source("".join(joined), script=True)
    if not any(rule == WRAP.id for _, rule in result.swap_rules):
        return None
    out_cells, current = [], None  # the ported text split at the markers left at the top
    for line in split_lines(result.text):
        if line.startswith(_MARK):
            current = {"cell_type": "code", "metadata": {}, "execution_count": None,
                       "outputs": [], "source": [], "_from": int(line[len(_MARK):])}
            out_cells.append(current)
        elif line.strip().startswith(_MARK):  # a cell now inside train_fn: say where from
            current["source"].append(line.replace(_MARK, "# from cell ", 1))
        else:
            current["source"].append(line)
    guard = next(i for i, line in enumerate(out_cells[-1]["source"])
                 if line.startswith('if __name__ == "__main__":'))
    run = out_cells[-1]["source"][guard:]
    del out_cells[-1]["source"][guard:]
    out_cells.append({"cell_type": "code", "metadata": {}, "execution_count": None,
                      "outputs": [], "source": [line[4:] if line.startswith("    ") else line
                                                for line in run[1:]]})
    for cell in out_cells:  # a cell magic may stay only on its cell's first line
        source = cell["source"]
        while source and not source[-1].strip():
            source.pop()
        if source:
            source[-1] = source[-1].rstrip("\n")
        cell["source"] = [("# " + line if i and line.lstrip().startswith("%%") else line)
                          for i, line in enumerate(source)]
    # each other cell (markdown) goes before the first code cell that came after it
    ordered, run_cell = [c for c in out_cells[:-1] if c["source"]], out_cells[-1]
    for n, cell in enumerate(cells, 1):
        if cell.get("cell_type") != "code":
            at = next((i for i, c in enumerate(ordered) if c.get("_from", 0) > n), len(ordered))
            ordered.insert(at, cell)
    for cell in ordered:
        cell.pop("_from", None)
    notebook["cells"] = ordered + [run_cell]
    out = PortResult(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
    for line, what in result.swaps:
        cell, at = where[line - 1] if line <= len(where) else where[-1]
        out.swaps.append((at, f"cell {cell}: {what}"))
    for line, what in result.todo:
        cell, at = where[line - 1] if line <= len(where) else where[-1]
        out.todo.append((at, f"cell {cell}: {what}"))
    out.swap_rules, out.note_rules = result.swap_rules, result.note_rules
    return out


def port_notebook(original: str) -> PortResult:
    """The notebook's JSON text, ported (lines count from each cell's first)."""
    wrapped = _wrapped(json.loads(original))
    if wrapped is not None:
        return _with_import(json.loads(wrapped.text), wrapped)
    notebook = json.loads(original)
    out = PortResult("")
    optimizers: set = set()  # an optimizer made in one cell is stepped in another
    train_fns: set = set()  # a training function defined in one cell is called in another
    for n, cell in enumerate(notebook.get("cells", []), 1):
        if cell.get("cell_type") != "code":
            continue
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        result = port_source(source, optimizers, train_fns)
        cell["source"] = split_lines(result.text)
        out.swaps += [(line, f"cell {n}: {what}") for line, what in result.swaps]
        out.todo += [(line, f"cell {n}: {what}") for line, what in result.todo]
        out.swap_rules += result.swap_rules
        out.note_rules += result.note_rules
    return _with_import(notebook, out)


def _with_import(notebook, out: PortResult) -> PortResult:
    """`import tpu_utility as tu` in the first code cell, where a swap was made."""
    first = next((cell for cell in notebook["cells"] if cell.get("cell_type") == "code"), None)
    if out.swaps and first is not None:
        if isinstance(first["source"], str):
            first["source"] = split_lines(first["source"])
        magics = 0  # a cell magic (%%time, %%capture) must stay the cell's first line
        while magics < len(first["source"]) and first["source"][magics].startswith("%%"):
            magics += 1
        first["source"][magics:magics] = ["import tpu_utility as tu\n"]
    out.text = json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"
    return out
