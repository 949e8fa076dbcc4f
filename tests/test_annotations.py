"""Every annotation in tpu_utility resolves: `from __future__ import annotations` keeps them as
strings, so a name used in one but never imported (`Sequence` in progress.py once) only fails
when something asks, such as `typing.get_type_hints`, a docs build or a dataclass tool."""
import ast
import importlib
import inspect
import pkgutil
import typing

import tpu_utility


def _type_checking_names(module) -> dict:
    """What the module's `if TYPE_CHECKING:` blocks import, as the type checker would see it."""
    tree = ast.parse(inspect.getsource(module))
    names = {}
    for node in tree.body:
        if (isinstance(node, ast.If) and isinstance(node.test, (ast.Name, ast.Attribute))
                and ast.unparse(node.test).endswith("TYPE_CHECKING")):
            block = ast.Module(body=node.body, type_ignores=[])
            exec(compile(block, module.__file__, "exec"), {"__name__": module.__name__,
                                                          "__package__": module.__package__}, names)
    return names


def _functions(module):
    """(qualified name, function) of every function and method the module defines."""
    for name, obj in vars(module).items():
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            yield name, obj
        elif inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                elif isinstance(member, property):
                    member = member.fget
                if inspect.isfunction(member):
                    yield f"{name}.{attr}", member


def test_every_annotation_in_the_package_resolves():
    modules = [tpu_utility] + [importlib.import_module(m.name) for m in pkgutil.walk_packages(
        tpu_utility.__path__, "tpu_utility.") if not m.name.endswith("__main__")]
    checked, broken = 0, {}
    for module in modules:
        namespace = {**vars(module), **_type_checking_names(module)}
        for name, fn in _functions(module):
            checked += 1
            try:
                typing.get_type_hints(fn, globalns=namespace)
            except Exception as e:  # NameError for a missing import, or any other failure
                broken[f"{module.__name__}.{name}"] = f"{type(e).__name__}: {e}"
    assert broken == {}
    assert len(modules) > 40 and checked > 300  # it did look at the package
