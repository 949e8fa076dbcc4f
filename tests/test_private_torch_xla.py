"""Every private torch_xla call lives in tpu_utility/compat.py (its docstring, the README,
docs/guide.md and docs/internals.md say so): a static scan of the rest of the package.

What counts as private torch_xla access, found with `ast` and without importing torch_xla:
- importing a torch_xla module or name that starts with "_" (`torch_xla._internal`,
  `from torch_xla import _XLAC`, `importlib.import_module("torch_xla._internal.tpu")`);
- `._name` (or `getattr(x, "_name")`) on anything reached from a torch_xla import in the same
  file: the module itself, what it returns, and names assigned from those;
- `._name` on any other object where `_name` is a private member that torch_xla's own classes
  define (`self._loader = ...` in parallel_loader.py, say) and tpu_utility does not: objects
  that torch_xla returns travel between functions, where no simple flow analysis follows them.
Attributes of names imported from elsewhere (`os._exit`, `sys._getframe`) and the package's
own private names (`self._x`, its `_helpers`) are not torch_xla's.
"""
import ast
import warnings
import importlib.util
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tpu_utility"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def torch_xla_private_members() -> set:
    """Private method and instance-attribute names defined by torch_xla's Python classes."""
    spec = importlib.util.find_spec("torch_xla")  # finds it without importing it
    names = set()
    for path in Path(spec.submodule_search_locations[0]).rglob("*.py"):
        with warnings.catch_warnings():  # its sources' own invalid escapes ('\_'): not ours
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(path.read_text(errors="replace"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names.update(b.name for b in node.body
                              if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(b.name))
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id == "self" and _private(node.attr)):
                names.add(node.attr)
    return names


def own_private_names(trees) -> set:
    """Private names tpu_utility defines itself: functions, classes, attributes it assigns,
    module-level names, its modules."""
    names = {p.stem for p in PACKAGE.rglob("*.py")} | {p.name for p in PACKAGE.rglob("*") if p.is_dir()}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if _private(n)}


def _root(node):
    """The name an attribute/call/subscript chain starts from (`a` in `a.b(c)[0].d`), or None."""
    while True:
        if isinstance(node, ast.Attribute):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Name):
            return node.id
        else:
            return None


def _bound_names(target):
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Starred):
        return _bound_names(target.value)
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for t in target.elts for n in _bound_names(t)]
    return []


def _xla_module(name: str) -> bool:
    return name == "torch_xla" or name.startswith("torch_xla.")


def private_accesses(source: str, xla_private: set, own: set) -> list:
    """(line, text) of each private torch_xla access in `source`."""
    tree = ast.parse(source)
    found = []
    xla_names, other_imports = set(), set()

    def flag(node, why):
        found.append((node.lineno, f"{why}: {ast.unparse(node)}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                if _xla_module(alias.name):
                    xla_names.add(bound)
                    if any(_private(part) for part in alias.name.split(".")):
                        flag(node, "private torch_xla module")
                else:
                    other_imports.add(bound)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                bound = alias.asname or alias.name
                if _xla_module(node.module):
                    xla_names.add(bound)
                    if any(_private(part) for part in node.module.split(".")) or _private(alias.name):
                        flag(node, "private torch_xla import")
                else:
                    other_imports.add(bound)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and _xla_module(node.args[0].value)
              and any(_private(part) for part in node.args[0].value.split("."))):
            flag(node, "private torch_xla module by name")  # importlib.import_module("torch_xla._...")

    # Names assigned from torch_xla, to a fixed point: `loader = pl.MpDeviceLoader(...)`,
    # `it = iter(loader)`, `for batch in loader`.
    def from_xla(expr):
        if (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name)
                and expr.func.id in ("iter", "next") and expr.args):
            return from_xla(expr.args[0])
        return _root(expr) in xla_names
    changed = True
    while changed:
        changed = False
        for node in ast.walk(tree):
            pairs = []
            if isinstance(node, ast.Assign):
                pairs = [(t, node.value) for t in node.targets]
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                pairs = [(node.target, node.value)]
            elif isinstance(node, (ast.For, ast.comprehension)):
                pairs = [(node.target, node.iter)]
            elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                pairs = [(node.optional_vars, node.context_expr)]
            for target, value in pairs:
                if from_xla(value):
                    for name in _bound_names(target):  # `x = ...`, `a, b = ...`; not `self.x = ...`
                        if name not in xla_names:
                            xla_names.add(name)
                            changed = True

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            attr, base = node.attr, node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            attr, base = node.args[1].value, node.args[0]
        else:
            continue
        if not _private(attr):
            continue
        root = _root(base)
        if root in xla_names:
            flag(node, "private attribute of a torch_xla object")
        elif (root not in ("self", "cls") and root not in other_imports
              and attr in xla_private and attr not in own):
            flag(node, f"{attr} is private to torch_xla's classes")
    return sorted(set(found))


def _scan_setup():
    files = {p: p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}
    return files, torch_xla_private_members(), own_private_names(ast.parse(s) for s in files.values())


def test_no_private_torch_xla_access_outside_compat():
    files, xla_private, own = _scan_setup()
    assert "_loader" in xla_private and "_loader" not in own  # what the scan relies on
    found = {str(p.relative_to(PACKAGE)): private_accesses(s, xla_private, own)
             for p, s in files.items() if p.name != "compat.py"}
    found = {p: f for p, f in found.items() if f}
    assert found == {}, found


def test_the_scan_catches_what_compat_py_does():
    # The scan is only worth something if it sees the private calls compat.py holds.
    files, xla_private, own = _scan_setup()
    compat = private_accesses(files[PACKAGE / "compat.py"], xla_private, own)
    texts = " ".join(t for _, t in compat)
    for expected in ("torch_xla._XLAC", "from torch_xla._internal import pjrt",
                     "pjrt._run_thread_per_device", "batches._loader"):
        assert expected in texts, compat
    made_up = textwrap.dedent("""
        import os, sys, importlib
        import torch_xla.core.xla_model as xm
        from torch_xla import _XLAC
        import torch_xla._internal.tpu
        def f(feed, m):
            it = iter(feed)
            it._loader.close()                       # an object torch_xla returned, passed in
            xm.xla_device()._private                 # a torch_xla object
            getattr(xm, "_hidden")
            importlib.import_module("torch_xla._internal.pjrt")
            os._exit(0), sys._getframe(), m._buffers, self._mine   # not torch_xla's
    """)
    lines = [line for line, _ in private_accesses(made_up, xla_private, own)]
    assert lines == [4, 5, 8, 9, 10, 11], private_accesses(made_up, xla_private, own)
