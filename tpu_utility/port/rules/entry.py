"""Entry rules: absl's `app.run(main)` parses the flags, calls main(argv) and exits the
process with its result. Under tu.run that exit would end a replica, and a replica that
spawn started afresh has parsed no flags. So `app.run(main)` where main trains becomes
`tu.run(main_tpu, cores=8, args=(sys.argv,))`, main_tpu parsing the flags itself and
returning main's result; inside a function port already runs through tu.run (the wrap of
a script's top level), it becomes the call `main(app.parse_flags_with_usage(sys.argv))`."""
from __future__ import annotations

import ast

from ..facts import dotted
from .rule import Context, Rule, always

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _absl_runs(tree) -> list:
    """The `app.run(main)` calls of a module that imports absl."""
    if not any(isinstance(n, (ast.Import, ast.ImportFrom)) and "absl" in ast.dump(n)
               for n in ast.walk(tree)):
        return []
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and dotted(n.func).endswith("app.run")
            and len(n.args) == 1 and not n.keywords and isinstance(n.args[0], ast.Name)]


def _needs_sys(ctx: Context, tree) -> None:
    """`import sys` above the first import, where the module has none."""
    if any(isinstance(n, ast.Import) and any(a.name == "sys" and not a.asname for a in n.names)
           for n in tree.body):
        return
    first = next((s for s in tree.body if isinstance(s, (ast.Import, ast.ImportFrom))), None)
    line = first.lineno if first is not None else 1
    ctx.edits.edits.append((line, 0, line, 0, "import sys\n"))


def _app_run(ctx: Context, tree) -> None:
    taken = {n.name for n in ast.walk(tree) if isinstance(n, _FUNCTIONS)}
    for node in _absl_runs(tree):
        fn, app = node.args[0].id, ctx.edits.source(node.func.value)
        parse = f"{app}.parse_flags_with_usage"
        if any(isinstance(p, _FUNCTIONS) for p, _ in ctx.facts.ancestors(node)):
            ctx.edits.replace(node, f"{fn}({parse}(sys.argv))", f"{app}.run({fn}) -> "
                              f"{fn}({parse}(sys.argv)): tu.run already runs this function, "
                              f"and absl's sys.exit would end the replica")
        elif fn in ctx.train_fns:
            entry = next(n for n in (f"{fn}_tpu", f"{fn}_tpu_entry", f"_{fn}_tpu") if n not in taken)
            stmt = next(s for s in tree.body if s.lineno <= node.lineno <= s.end_lineno)
            ctx.edits.edits.append((stmt.lineno, 0, stmt.lineno, 0, (
                f"def {entry}(argv):\n"
                f"    # {app}.run({fn}) parsed the flags, then exited with {fn}'s result: each\n"
                f"    # replica parses them here (spawn starts it afresh), and the result returns\n"
                f"    return {fn}({parse}(argv))\n\n\n")))
            ctx.edits.replace(node, f"tu.run({entry}, cores=8, args=(sys.argv,))",
                              f"{app}.run({fn}) -> tu.run({entry}, cores=8, args=(sys.argv,)), "
                              f"{entry} parsing the flags in each replica and returning "
                              f"{fn}'s result instead of exiting with it")
        else:
            continue
        _needs_sys(ctx, tree)


PASSES = [
    Rule("entry.absl-app-run", "absl's `app.run(main)` where main trains becomes "
         "`tu.run(main_tpu, cores=8, args=(sys.argv,))`, main_tpu parsing the flags and "
         "returning main's result (no sys.exit in a replica); inside a function tu.run runs, "
         "`main(app.parse_flags_with_usage(sys.argv))`", ast.Module, always, _app_run),
]
