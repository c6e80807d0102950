"""README.md's examples stay runnable. Every ```python block stands alone (its own imports, every tensor made in
it); on the CPU each one compiles and every name it reads is defined before it is read, in the block itself, or is
a builtin (``ast`` for the order of top-level statements, ``symtable`` for the names inside lambdas, functions and
comprehensions); names it assigns are read again, except the results ``out`` / ``lse`` (an unread name is usually a
name the example forgot to use or define: issue 33's plan example). On a GPU each block runs as written. Every
``python -m mla.prebuild`` command line of the README runs with ``--list``.

Illustrative code that cannot run goes in a ```text block, which is not checked."""

import ast
import builtins
import pathlib
import re
import shlex
import symtable
import sys
import types

import pytest

from conftest import requires_gpu
from helpers import launches
from mla import prebuild

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
RESULT_NAMES = {"out", "lse"}  # what an example computes to show the call; not read again
BUILTINS = set(dir(builtins))


def blocks(language):
    """(first line number, source) of every fenced block of ``language`` in README.md."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(2)) for m in FENCE.finditer(text) if m.group(1) == language]


PYTHON_BLOCKS = blocks("python")
IDS = [f"README.md:{line}" for line, _ in PYTHON_BLOCKS]


def _bound(node) -> set:
    """Names a top-level statement binds in the module scope (not inside nested scopes)."""
    names = set()
    for sub in _walk_scope(node):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
            names.add(sub.id)
        elif isinstance(sub, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in sub.names)
        elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(sub.name)
    return names


def _walk_scope(node):
    """ast.walk without descending into nested scopes (their bodies are symtable's), but with the parts of them
    that run in this scope: default values, decorators, a comprehension's first iterable."""
    stack = [node]
    while stack:
        sub = stack.pop()
        yield sub
        if isinstance(sub, ast.Lambda):
            stack += sub.args.defaults + [d for d in sub.args.kw_defaults if d is not None]
        elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
            stack += sub.decorator_list + sub.args.defaults + [d for d in sub.args.kw_defaults if d is not None]
        elif isinstance(sub, ast.ClassDef):
            stack += sub.decorator_list + sub.bases
        elif isinstance(sub, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            stack.append(sub.generators[0].iter)
        else:
            stack += list(ast.iter_child_nodes(sub))


def _loaded(node) -> list:
    return [(sub.id, sub.lineno) for sub in _walk_scope(node)
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load)]


def _nested_free_names(table) -> set:
    """Names the nested scopes of a symtable read from the module scope (globals / free names)."""
    names = set()
    for child in table.get_children():
        for sym in child.get_symbols():
            if sym.is_referenced() and (sym.is_global() or sym.is_free()) and not sym.is_assigned():
                names.add(sym.get_name())
        names |= _nested_free_names(child)
    return names


def name_problems(source: str, where: str = "block") -> list[str]:
    """What is wrong with the names of a stand-alone example: a name read before (or without) its definition, or a
    name assigned and never read (other than ``RESULT_NAMES``)."""
    tree = ast.parse(source)
    defined, problems, all_bound, all_loaded = set(BUILTINS), [], set(), set()
    for stmt in tree.body:
        binds = _bound(stmt)
        # A compound statement (for, with, if, ...) binds names for its own body (the loop variable); a simple one
        # reads everything before it binds (``x = f(x)`` needs an earlier x).
        simple = not isinstance(stmt, (ast.For, ast.AsyncFor, ast.While, ast.If, ast.With, ast.AsyncWith, ast.Try))
        available = defined if simple else defined | binds
        for name, line in _loaded(stmt):
            if name not in available:
                problems.append(f"{where} line {line}: {name!r} is read but not defined before")
            all_loaded.add(name)
        defined |= binds
        all_bound |= binds
    for name in sorted(_nested_free_names(symtable.symtable(source, where, "exec")) - defined):
        problems.append(f"{where}: {name!r} is read inside a lambda / function / comprehension but never defined")
    all_loaded |= _nested_free_names(symtable.symtable(source, where, "exec"))
    imported = {n for stmt in tree.body if isinstance(stmt, (ast.Import, ast.ImportFrom)) for n in _bound(stmt)}
    for name in sorted(all_bound - all_loaded - RESULT_NAMES - imported):
        problems.append(f"{where}: {name!r} is assigned but never used")
    return problems


def test_readme_has_examples():
    assert len(PYTHON_BLOCKS) >= 6, "README.md lost its Python examples (or the fence pattern no longer matches)"


@pytest.mark.parametrize("line,source", PYTHON_BLOCKS, ids=IDS)
def test_example_compiles_and_defines_every_name(line, source):
    compile(source, f"README.md:{line}", "exec")
    problems = name_problems(source, where=f"README.md:{line}")
    assert not problems, "\n".join(problems)


# The checker itself, on the example issue 33 found broken (README at 7ef7344) and on its fixed form's patterns.
OLD_PLAN_EXAMPLE = '''
from mla.decode import plan
q_lens, kv_lens = [1, 1, 2], [100, 0, 3000]
qo_indptr, kv_indptr = [0, 1, 2, 4], [0, 100, 100, 3100]
step = plan(qo_indptr, kv_indptr, num_heads=16, kv_format="fp8", causal=True,
            page_size=64, kv_indices=kv_indices)
for layer in range(num_layers):
    out = step.run(q[layer], kv_pages[layer], kv_scale=kv_scale[layer])
'''


def test_checker_finds_the_old_plan_examples_faults():
    problems = "\n".join(name_problems(OLD_PLAN_EXAMPLE))
    for name in ("kv_indices", "num_layers", "q", "kv_pages", "kv_scale"):
        assert f"{name!r} is read but not defined" in problems, problems
    for name in ("q_lens", "kv_lens"):
        assert f"{name!r} is assigned but never used" in problems, problems
    assert "'layer'" not in problems and "'out'" not in problems


@pytest.mark.parametrize("source,bad", [
    ("x = 1\nf = lambda a: a + x + y\nf(2)", "'y' is read inside a lambda"),
    ("print(z)\nz = 1", "'z' is read but not defined before"),
    ("n = n + 1", "'n' is read but not defined before"),
    ("import torch\nt = [torch.zeros(i) for i in range(k)]\nprint(t)", "'k' is read but not defined before"),
])
def test_checker_cases(source, bad):
    assert any(bad in p for p in name_problems(source)), name_problems(source)


@pytest.mark.parametrize("source", [
    "import torch\nfor i in range(3):\n    print(torch.zeros(i))",
    "x = 2\nf = lambda a: a * x\nout = f(3)",
    "import mla.ops\nmla.ops.mla_decode",
    "xs = [1, 2]\nprint([v * 2 for v in xs])",
])
def test_checker_accepts(source):
    assert name_problems(source) == []


# --- the prebuild command lines -----------------------------------------------------------------------------------


PREBUILD_LINES = [cmd for _, block in blocks("bash") for cmd in block.splitlines()
                  if cmd.strip().startswith("python -m mla.prebuild")]


def test_readme_shows_the_prebuild_command():
    assert PREBUILD_LINES, "README.md shows no `python -m mla.prebuild` command"


@pytest.mark.parametrize("command", PREBUILD_LINES)
def test_prebuild_command_lines_are_valid(command, capsys):
    argv = shlex.split(command.split("#")[0])[3:]
    argv = [a for a in argv if a != "--list"]
    assert prebuild.main([*argv, "--list"]) == 0
    listed = capsys.readouterr().out.split()
    assert listed
    counted = re.search(r"#\s*(\d+) variants", command)
    if counted:  # the README says how many variants the command builds
        assert len(listed) == int(counted.group(1)), listed


# --- on a GPU: every example runs as written ------------------------------------------------------------------------


# What the examples launch, (mode, heads, q_tile, causal[, page_size[, flash]]), built in parallel before they run:
# Usage (4 modes), serving (128 heads, MTP, causal), paged, plan (fp8, paged, MTP tile 2, causal), torch.compile,
# FlashMLA (bf16, page 64; causal is a no-op for s_q = 1).
README_CLASSES = [(mode, 16, 1, False) for mode in ("bf16", "fp8", "a8w8", "mxfp4")] + [
    ("bf16", 128, 2, True), ("bf16", 16, 1, False, 64), ("fp8", 16, 2, True, 64), ("bf16", 16, 1, False, 64, True)]


@requires_gpu
@launches(lambda **_: README_CLASSES)
@pytest.mark.parametrize("line,source", PYTHON_BLOCKS, ids=IDS)
def test_example_runs_on_the_gpu(line, source):
    # Run as a module of its own (torch.compile looks a function's globals up by module name), then forget it.
    module = types.ModuleType(f"readme_example_{line}")
    sys.modules[module.__name__] = module
    try:
        exec(compile(source, f"README.md:{line}", "exec"), module.__dict__)  # noqa: S102 - the README's own examples
    finally:
        del sys.modules[module.__name__]
    namespace = module.__dict__
    import torch

    torch.cuda.synchronize()
    for name in RESULT_NAMES & namespace.keys():
        value = namespace[name]
        tensors = value if isinstance(value, tuple) else (value,)
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and name == "out":
                assert torch.isfinite(t).all(), f"README.md:{line}: non-finite values in {name}"
