"""The package modules import each other without a circle (issue 20): an import graph read from the
source (ast, every `import` including those inside functions, which are the usual way a circle is
hidden), with a module named by its installed name (`launch/` is `smlp_launch`, ...)."""
from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

from smlp.deprecation import MOVED, MOVED_NAMES, SPLIT

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"smlp": "smlp", "fairseq_plugins": "fairseq_plugins", "smlp_launch": "launch", "smlp_eval": "eval",
            "smlp_bench": "benchmarks"}


def modules() -> dict[str, Path]:
    """Installed module name -> source file, for every module of our packages."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Our modules that `name` imports (a `from M import x` imports M.x when that is a module, else M)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_circle_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_a_lazy_import_inside_a_function(tmp_path):
    source = tmp_path / "steptime.py"
    source.write_text("def f():\n    from .flops import OneGPUDispatcher\n")
    known = {"smlp_eval.steptime": source, "smlp_eval.flops": source}
    assert imports_of("smlp_eval.steptime", source, known) == {"smlp_eval.flops"}


def test_no_import_circle_among_our_modules():
    known = modules()
    assert {"smlp.dispatch", "smlp_eval.flops", "fairseq_plugins", "smlp_launch.data"} <= set(known)
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert "smlp_eval.flop_count" in graph["smlp_eval.flops"]  # the walk resolves relative imports
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_evaluation_and_the_core_import_no_launcher_and_data_preparation_no_model_code():
    """smlp_eval reads text through smlp_eval.text, not the launcher; the core imports only itself;
    data preparation and the launcher's argument checks import no model code (issue 20)."""
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    for name, deps in graph.items():
        if name.startswith("smlp_eval"):
            assert not [d for d in deps if d.startswith("smlp_launch")], name
        if name.startswith("smlp.") or name == "smlp":
            assert all(d.startswith("smlp.") or d == "smlp" for d in deps), name

    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    NOT_MODELS = {"smlp.third_party", "smlp.process_group"}  # start-up settings; rank and world size
    for entry in ("smlp_launch.data", "smlp_launch.local", "smlp_eval.text"):
        model_code = {m for m in reach(entry) if m.startswith(("smlp.", "fairseq_plugins")) and m not in NOT_MODELS}
        assert not model_code, (entry, model_code)


@pytest.mark.parametrize("old", [*MOVED, *SPLIT])
def test_every_old_module_path_still_imports_and_warns(old):
    """For one release every moved module path imports, with a DeprecationWarning that names the new home and
    points at the importing line; a module moved whole is the new module itself (one object: its classes,
    pickles and monkeypatches are the same), a split one re-exports each name from where it went."""
    sys.modules.pop(old, None)  # imported before (by another test): import it afresh
    with pytest.warns(DeprecationWarning) as caught:
        module = importlib.import_module(old)
    (warning,) = [w for w in caught if old in str(w.message)]
    assert warning.filename == __file__, warning.filename
    if old in MOVED:
        assert f"import {MOVED[old]} instead" in str(warning.message)
        assert module is importlib.import_module(MOVED[old])
    else:
        for name, home in SPLIT[old].items():
            assert f"{name} from {home}" in str(warning.message)
            assert getattr(module, name) is getattr(importlib.import_module(home), name)
        assert sorted(module.__all__) == sorted(SPLIT[old])


@pytest.mark.parametrize("module, name", [(m, n) for m, names in MOVED_NAMES.items() for n in names])
def test_every_name_that_left_a_module_still_imports_from_it_and_warns(module, name):
    with pytest.warns(DeprecationWarning, match=f"{module}.{name} is deprecated") as caught:
        value = getattr(importlib.import_module(module), name)
    assert caught[0].filename == __file__
    assert value is getattr(importlib.import_module(MOVED_NAMES[module][name]), name)
    with pytest.raises(AttributeError):
        _ = importlib.import_module(module).no_such_name
