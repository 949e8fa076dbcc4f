"""The code's shape, as issue 31 set it: no import cycle (imports inside functions
counted), replica state written only by its owner, one ContextVar, and the engine, the
launcher's child entry and the loader small enough to read. Read from the source with
`ast`; nothing is imported or run."""
import ast
import os
import re

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tpu_utility")


def modules() -> dict:
    """{dotted name: path} of every module in the package (a package is its __init__)."""
    out = {}
    root = os.path.dirname(PACKAGE)
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def imports(name: str, path: str, known: dict) -> set:
    """The package's modules that `name` imports when run, at any depth, inside functions
    too; not those under `if TYPE_CHECKING:`, which never run."""
    tree = ast.parse(open(path).read())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(block.test)
                   for stmt in block.body for n in ast.walk(stmt)}
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(max(node.level - 1, 0)):
                base = base.rpartition(".")[0]
            mod = (base + ("." + node.module if node.module else "")) if node.level else node.module
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            parts = target.split(".") if target else []
            # a.b.c runs a.b's __init__ first, unless the importer is inside a.b already
            for i in range(2, len(parts) + 1):
                step = ".".join(parts[:i])
                implicit = i < len(parts)
                if step in known and step != name and not (implicit and name.startswith(step + ".")):
                    out.add(step)
    return out


def cycles(graph: dict) -> list:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, groups, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return groups


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path):
    # The old engine/rng shape: rng imports the engines at the top, an engine method
    # imports rng inside a function.
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "rng.py").write_text("from .engine import current\n")
    (tmp_path / "pkg" / "engine.py").write_text("def f():\n    from . import rng\n")
    (tmp_path / "pkg" / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .engine import f\n")
    known = {"pkg": str(tmp_path / "pkg" / "__init__.py")}
    known.update({f"pkg.{m}": str(tmp_path / "pkg" / f"{m}.py") for m in ("rng", "engine", "typed")})
    graph = {m: imports(m, p, known) for m, p in known.items()}
    assert cycles(graph) == [["pkg.engine", "pkg.rng"]]
    assert graph["pkg.typed"] == set()


def test_no_import_cycle_counting_imports_inside_functions():
    known = modules()
    graph = {m: imports(m, p, known) for m, p in known.items()}
    assert cycles(graph) == []


def source_files():
    return [p for p in modules().values()]


def test_replica_state_is_written_by_its_owner_alone():
    # Engines are backends: nothing outside engines/ sets an attribute on one, and the
    # engines keep none of the replica's bookkeeping.
    writes, kept = [], []
    for path in source_files():
        text = open(path).read()
        inside = os.sep + "engines" + os.sep in path
        for n, line in enumerate(text.splitlines(), 1):
            if not inside and re.search(r"\bengine\.[a-z_]+ = ", line):
                writes.append(f"{path}:{n}")
            if inside and re.search(r"\.(heartbeat|rng_offset_applied|owns_host_rng|_synced_state|rng_moved)\b", line):
                kept.append(f"{path}:{n}")
    assert writes == [] and kept == []


def test_one_context_variable_in_the_package():
    made = [p for p in source_files() if "ContextVar(" in open(p).read()]
    assert [os.path.relpath(p, PACKAGE) for p in made] == ["replica.py"]


def definition(path: str, dotted: str) -> ast.AST:
    node = ast.parse(open(os.path.join(PACKAGE, path)).read())
    for part in dotted.split("."):
        node = next(n for n in node.body if getattr(n, "name", None) == part)
    return node


def parameters(fn) -> list:
    return [a.arg for a in fn.args.args + fn.args.kwonlyargs]


def test_the_engine_the_child_entry_and_the_loader_stay_small():
    engine = definition("engines/base.py", "Engine")
    assert engine.end_lineno - engine.lineno + 1 <= 170
    assert len(parameters(definition("engines/base.py", "Engine.start"))) - 1 <= 3  # besides cls
    assert len(parameters(definition("launch/child.py", "process_main"))) <= 2
    assert len(parameters(definition("data/loader.py", "DeviceLoader.__init__"))) <= 2  # self, spec


def test_every_file_of_the_data_package_reads_in_a_few_minutes():
    sizes = {f: sum(1 for _ in open(os.path.join(PACKAGE, "data", f)))
             for f in os.listdir(os.path.join(PACKAGE, "data")) if f.endswith(".py")}
    assert max(sizes.values()) <= 250, sizes


def test_the_replica_is_a_record():
    # Issue 49: the replica held train_one_cycle's running loss, check_functionalization's
    # counter and the optimizer step over replicas; those live in loop/, functionalization.py
    # and step.py, and reach the replica through its one hook (`on_step`).
    known = modules()
    took = imports("tpu_utility.replica", known["tpu_utility.replica"], known)
    assert not {m for m in took if m.startswith("tpu_utility.loop")
                or m in ("tpu_utility.functionalization", "tpu_utility.fused_step",
                         "tpu_utility.in_place", "tpu_utility.step")}, took
    record = definition("replica.py", "Replica")
    assert record.end_lineno - record.lineno + 1 <= 120
    launch = [p for name, p in known.items() if name.startswith("tpu_utility.launch")]
    assert launch and not [p for p in launch if re.search(r"check_steps|StepLimit", open(p).read())]
