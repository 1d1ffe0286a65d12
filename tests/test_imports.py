"""The package modules import each other without a circle (issue 20): an import graph read from the
source (ast, every `import` including those inside functions, which are the usual way a circle is
hidden), with a module named by its installed name (`launch/` is `smlp_launch`, ...)."""
from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

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


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between top-level folders (installed names: smlp, fairseq_plugins, smlp_eval, ...):
    folder A imports folder B when any module of A imports any module of B, at file or function level."""
    folders: dict[str, set[str]] = {}
    for name, deps in graph.items():
        top = name.split(".")[0]
        folders.setdefault(top, set()).update(d.split(".")[0] for d in deps if d.split(".")[0] != top)
    return folders


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
    assert "smlp_eval.flops.counting" in graph["smlp_eval.flops"]  # the walk resolves relative imports
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_folder_graph_sees_a_circle_that_no_two_modules_form(tmp_path):
    """A function-level import of smlp_eval from a plugin module, while smlp_eval imports another plugin
    module: no module-level circle, but a circle between the two folders."""
    sources = {"fairseq_plugins.generation": "def fill():\n    from smlp_eval.text import Encoder\n",
               "fairseq_plugins.checkpoints": "import torch\n",
               "smlp_eval.zeroshot": "from fairseq_plugins.checkpoints import load_for_eval\n",
               "smlp_eval.text": "import os\n"}
    known = {}
    for name, source in sources.items():
        known[name] = tmp_path / f"{name}.py"
        known[name].write_text(source)
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert find_cycle(graph) is None
    assert find_cycle(folder_graph(graph)) == ["fairseq_plugins", "smlp_eval", "fairseq_plugins"]


def test_no_import_circle_between_top_level_folders():
    """The folders depend on each other one way (issue 27): smlp <- fairseq_plugins <- smlp_eval <- smlp_launch
    <- smlp_bench, whether through file-level or function-level imports of the installed names."""
    known = modules()
    folders = folder_graph({name: imports_of(name, path, known) for name, path in known.items()})
    cycle = find_cycle(folders)
    assert cycle is None, "import circle between folders: " + " -> ".join(cycle)
    assert folders["smlp"] == set()  # the core imports only itself


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

    # start-up; ranks; the atomic writer; one job per save folder
    NOT_MODELS = {"smlp.third_party", "smlp.process_group", "smlp.files", "smlp.folder_lock"}
    # a worker (smlp-launch --worker, its own process) checks its fairseq-train flags with the model's code
    # (smlp_launch.preflight) before fairseq-train runs there; the launcher's own checks never reach it
    assert "smlp_launch.preflight" in graph["smlp_launch.worker"]
    graph["smlp_launch.worker"] = graph["smlp_launch.worker"] - {"smlp_launch.preflight"}
    for entry in ("smlp_launch.data", "smlp_launch.local", "smlp_eval.text"):
        model_code = {m for m in reach(entry) if m.startswith(("smlp.", "fairseq_plugins")) and m not in NOT_MODELS}
        assert not model_code, (entry, model_code)



# ---------------------------------------------------------------- no compatibility shims

# paths that moved before the first release: gone, not served from their old names
REMOVED = ("smlp.routers", "smlp.gates", "smlp.assignment", "smlp.decoding", "smlp.parallel", "smlp.sharding",
           "smlp.numerics", "smlp.causal", "smlp.mixers", "smlp.token_mixers", "smlp.deprecation",
           "fairseq_plugins.shard_sets", "fairseq_plugins.sharded_optim", "smlp_eval.flop_count",
           "smlp_eval.flop_match", "smlp_eval.flop_tables", "smlp_eval.paper_tables", "smlp_eval.model_spec",
           "smlp_eval.steptime", "smlp_bench.suite", "smlp_bench.records", "smlp_bench.hot_path")


@pytest.mark.parametrize("old", REMOVED)
def test_a_moved_module_is_gone_from_its_old_path(old):
    sys.modules.pop(old, None)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_no_module_stands_in_for_another():
    """No module replaces itself in sys.modules, re-exports another with `import *`, or serves names through a
    module `__getattr__` (which breaks go-to-definition)."""
    offenders = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only
            text = ast.unparse(node)
            if isinstance(node, ast.Assign) and text.startswith("sys.modules["):
                offenders.append((name, text[:80]))
            if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
                offenders.append((name, text[:80]))
            if (isinstance(node, ast.FunctionDef) and node.name == "__getattr__") or (
                    isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__getattr__" for t in node.targets)):
                offenders.append((name, text[:80]))
    assert not offenders, offenders


def test_every_test_of_a_slurm_cluster_is_scheduled_with_the_others(request):
    """`make test`'s 2 workers (conftest.xdist_scope): a test that uses a local SLURM cluster (the slurm or slurm2
    fixture) must be in the "slurm" unit, or two workers could start and stop one cluster under each other."""
    from conftest import xdist_scope

    items = [i for i in request.session.items if {"slurm", "slurm2"} & set(getattr(i, "fixturenames", ()))]
    assert all(xdist_scope(i.nodeid) == "slurm" for i in items), [i.nodeid for i in items]
    assert xdist_scope("tests/test_core.py::test_x[a-b]") == "tests/test_core.py"
    assert xdist_scope("tests/test_faults.py::test_slurm_time_limit") == "slurm"


# ---------------------------------------------------------------- the layout

MAX_MODULE_LINES = 700


def test_no_module_is_past_700_lines():
    """A module a reader can hold: past 700 lines a module holds more than one thing (split it by what it holds)."""
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long


def test_no_two_modules_of_a_package_share_a_name():
    """One name, one module within a package (smlp.gates beside smlp.routing.gates made a reader open both)."""
    by_package: dict[tuple[str, str], list[str]] = {}
    for name in modules():
        parts = name.split(".")
        if parts[-1] not in ("__init__", "__main__"):
            by_package.setdefault((parts[0], parts[-1]), []).append(name)
    twins = {k: v for k, v in by_package.items() if len(v) > 1}
    assert not twins, twins
