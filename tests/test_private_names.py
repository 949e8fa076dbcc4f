"""No module of the package uses another's private name (`from .datasets import _files`,
`port._Finder`), and torch's private functions are called from compat.py alone, as
torch_xla's are (test_private_torch_xla.py): a static scan with `ast`, nothing imported.
torch's `_foreach_*` ops are the exception: torch.optim's own public steps are built on
them, so they are as stable as those. (recompute.py wraps torch.utils.checkpoint's private
classes, which is its one concern; it names that module, not `torch`.)"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tpu_utility"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def uses(path: Path) -> list:
    """`file:line name` for each private name this file takes from another module of the
    package, or from torch."""
    tree = ast.parse(path.read_text())
    package_modules = set()  # local names bound to the package's modules
    torch_names = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            ours = node.level > 0 or (node.module or "").startswith("tpu_utility")
            for alias in node.names:
                if ours and _private(alias.name):
                    found.append(f"{path.name}:{node.lineno} {alias.name}")
                if ours:
                    package_modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch" or (alias.name.startswith("torch.") and not alias.asname):
                    torch_names.add(alias.asname or "torch")
                elif alias.name.startswith("tpu_utility"):
                    package_modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) \
                and isinstance(node.value, ast.Name):
            if node.value.id in torch_names and not node.attr.startswith("_foreach_"):
                found.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
            elif node.value.id in package_modules and node.value.id not in ("self", "cls"):
                found.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    return found


def test_no_private_name_crosses_a_module_and_torchs_private_calls_live_in_compat():
    found = [use for path in sorted(PACKAGE.rglob("*.py")) if path.name != "compat.py"
             for use in uses(path)]
    assert found == [], found


def test_the_scan_finds_each_kind_of_use(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom .datasets import _image_files\nfrom . import rules\n"
                   "x = torch._is_functional_tensor\ny = rules._Finder\n"
                   "z = torch._foreach_copy_\n")
    assert uses(bad) == ["bad.py:2 _image_files", "bad.py:4 torch._is_functional_tensor",
                         "bad.py:5 rules._Finder"]

