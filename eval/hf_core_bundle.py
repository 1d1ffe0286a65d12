"""The smlp core, packed into one Python source that a Hugging Face modeling file can carry.

A model folder's modeling code must be one self-contained file (transformers copies the file named
in `auto_map`, plus flat `from .x import` siblings, into its module cache, and nothing else), and it
must run the same layers as `smlp/`, not a second implementation. So `smlp-export` embeds the core's
own sources in the file it writes:

1. `core_modules(root)`: starting from the module that defines `LanguageModel`, read each module's
   source and follow every import of an `smlp` module in it (absolute `smlp.x` or relative `.x` /
   `..x`, at the top or inside a function or an `if TYPE_CHECKING:` block, submodules named in
   `from pkg import name` included), plus the `__init__` of every package on the way. The walk reads
   files where Python finds them (`importlib.util.find_spec`), so it does not depend on how `smlp/`
   is laid out: modules may move, split or sit in nested packages.
2. Every import that leaves `smlp` must be the standard library, torch or numpy (a requirement of
   transformers itself); anything else (fairseq, say) stops the export with the module that imports it.
3. `bundle_source(...)` writes the sources as tuples of line literals (one `repr` per line: no
   quoting problems, and transformers' scan for `from .x import` lines, which would otherwise ask for
   sibling files, does not see them) and a small importer that registers them at import time under a
   private package `_smlp_core_<digest of the sources>`. Relative imports inside the core keep
   working; absolute ones (`from smlp.x import y`, `import smlp.x`) are pointed at the private
   package when a module is compiled (an AST rewrite of the import statements only: the embedded text
   and its line numbers stay the original's). Private names of different modules stay in their own
   modules, and two folders exported from different versions of the core load side by side in one
   process, beside an installed smlp or without one.

Tracebacks from the embedded code name the original file (`smlp/lm.py (embedded)`) and show its
lines (the importer is the modules' `__loader__` and answers `get_source`).
"""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CoreModule", "BundleError", "core_modules", "bundle_source", "bundle_package", "ALLOWED_EXTERNAL"]

# Imports the embedded core may make besides the standard library: what transformers needs anyway.
ALLOWED_EXTERNAL = ("torch", "numpy")


class BundleError(ValueError):
    """The core cannot be packed (a module not found as source, an import outside the allowed ones)."""


@dataclass(frozen=True)
class CoreModule:
    name: str          # e.g. "smlp.lm", "smlp.routing.gates"
    source: str
    is_package: bool   # an __init__.py
    path: str          # where it was read, relative to the folder holding its top package

    @property
    def relative(self) -> str:
        """The name inside the top package: "" for `smlp` itself, "lm", "routing.gates"."""
        return self.name.partition(".")[2]


def _in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _spec(name: str):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def _read(name: str) -> CoreModule:
    spec = _spec(name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise BundleError(f"the core module {name} was not found as a Python source file "
                          f"({getattr(spec, 'origin', None) or 'not importable'}): the export embeds the sources")
    path = Path(spec.origin)
    is_package = spec.submodule_search_locations is not None
    depth = name.count(".") + (2 if is_package else 1)  # path components from the folder above `smlp`
    return CoreModule(name=name, source=path.read_text(encoding="utf-8"), is_package=is_package,
                      path="/".join(path.parts[-depth:]))


def _resolve(module: CoreModule, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    parts = package.split(".")
    if node.level - 1 >= len(parts):
        raise BundleError(f"{module.path}: `from {'.' * node.level}{node.module or ''} import ...` goes above the "
                          f"{parts[0]} package")
    base = ".".join(parts[:len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def _imports(module: CoreModule) -> tuple[set[str], set[tuple[str, int]]]:
    """(modules of its own package that `module` imports, (external top-level name, line) pairs)."""
    package = module.name.partition(".")[0]
    core, external = set(), set()
    for node in ast.walk(ast.parse(module.source, module.path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _in_package(alias.name, package):
                    core.add(alias.name)
                else:
                    external.add((alias.name.split(".")[0], node.lineno))
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            if not _in_package(target, package):
                if target != "__future__":
                    external.add((target.split(".")[0], node.lineno))
                continue
            core.add(target)
            for alias in node.names:  # `from .pkg import sub` imports the submodule pkg.sub
                sub = f"{target}.{alias.name}"
                if alias.name != "*" and _spec_is_module(sub):
                    core.add(sub)
    return core, external


def _spec_is_module(name: str) -> bool:
    parent = name.rpartition(".")[0]
    spec = _spec(parent)
    if spec is None or spec.submodule_search_locations is None:  # not a package: `name` is an attribute
        return False
    return _spec(name) is not None


def core_modules(root: str) -> list[CoreModule]:
    """`root` (a module of the smlp package) and every module of its package it needs, in name order
    (see the module docstring)."""
    found: dict[str, CoreModule] = {}
    todo = [root]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        module = found[name] = _read(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # the packages on the way
        core, external = _imports(module)
        todo += sorted(core)
        for top, line in sorted(external):
            if top not in ALLOWED_EXTERNAL and top not in sys.stdlib_module_names:
                raise BundleError(f"{module.path}:{line} imports {top}: the exported modeling file may import only "
                                  f"the standard library, {', '.join(ALLOWED_EXTERNAL)} and transformers")
    return [found[n] for n in sorted(found)]


def bundle_package(modules: list[CoreModule]) -> str:
    """The private package name: fixed by the sources, so equal cores share it and different ones do not."""
    digest = hashlib.sha256()
    for m in modules:
        digest.update(f"{m.name}\0{int(m.is_package)}\0{m.source}\0".encode())
    return f"_{modules[0].name.partition('.')[0]}_core_{digest.hexdigest()[:16]}"


_IMPORTER = '''
class _PrivateImports(ast.NodeTransformer):
    """Absolute imports of the original package (`from smlp.x import y`, `import smlp.x`) in the embedded
    code name the private package instead; line numbers stay those of the embedded source."""

    def __init__(self, original, package):
        self.original, self.package = original, package

    def _private(self, name):
        if name == self.original or name.startswith(self.original + "."):
            return self.package + name[len(self.original):]
        return None

    def visit_ImportFrom(self, node):
        if not node.level and node.module and self._private(node.module):
            node.module = self._private(node.module)
        return node

    def visit_Import(self, node):
        kept, bound = [], []
        for alias in node.names:
            private = self._private(alias.name)
            if private is None:
                kept.append(alias)
            elif alias.asname:  # `import smlp.x as y` binds the submodule
                kept.append(ast.alias(private, alias.asname))
            else:  # `import smlp.x` binds the top package to the name smlp
                call = ast.Call(ast.Name("__import__", ast.Load()), [ast.Constant(private)], [])
                bound.append(ast.Assign([ast.Name(alias.name.split(".")[0], ast.Store())], call))
        out = ([ast.Import(kept)] if kept else []) + bound
        return [ast.copy_location(stmt, node) for stmt in out]


class _EmbeddedCore(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """Imports the embedded modules (_CORE_SOURCES) of package _CORE_ORIGINAL as the package _CORE_PACKAGE."""

    def __init__(self, original, package, sources):
        self.original, self.package, self.sources = original, package, sources

    def _entry(self, fullname):
        if fullname == self.package:
            return self.sources.get("")
        if fullname.startswith(self.package + "."):
            return self.sources.get(fullname[len(self.package) + 1:])
        return None

    def find_spec(self, fullname, path=None, target=None):
        entry = self._entry(fullname)
        if entry is None:
            return None
        spec = importlib.util.spec_from_loader(fullname, self, origin=entry[1] + " (embedded)",
                                               is_package=entry[0])
        spec.has_location = False
        return spec

    def is_package(self, fullname):
        return self._entry(fullname)[0]

    def get_source(self, fullname):
        return "\\n".join(self._entry(fullname)[2]) + "\\n"

    def get_code(self, fullname):
        filename = self._entry(fullname)[1] + " (embedded)"
        tree = _PrivateImports(self.original, self.package).visit(ast.parse(self.get_source(fullname), filename))
        return compile(ast.fix_missing_locations(tree), filename, "exec", dont_inherit=True)


def _import_core(module):
    """The embedded core module `module` (e.g. "lm"), registering the package on first use."""
    if not any(getattr(f, "package", None) == _CORE_PACKAGE for f in sys.meta_path):
        sys.meta_path.append(_EmbeddedCore(_CORE_ORIGINAL, _CORE_PACKAGE, _CORE_SOURCES))
    return importlib.import_module(f"{_CORE_PACKAGE}.{module}" if module else _CORE_PACKAGE)
'''


def bundle_source(modules: list[CoreModule]) -> str:
    """Python source defining _CORE_ORIGINAL, _CORE_PACKAGE, _CORE_SOURCES and `_import_core(relative_name)`."""
    package = bundle_package(modules)
    out = ["import ast", "import importlib", "import importlib.abc", "import importlib.util", "import sys", "",
           f"_CORE_ORIGINAL = {modules[0].name.partition('.')[0]!r}", f"_CORE_PACKAGE = {package!r}",
           "# relative module name -> (is a package, file it was read from, its lines)",
           "_CORE_SOURCES = {"]
    for m in modules:
        out.append(f"    {m.relative!r}: ({m.is_package!r}, {m.path!r}, (")
        out += [f"        {line!r}," for line in m.source.split("\n")[:-1 if m.source.endswith("\n") else None]]
        out.append("    )),")
    out.append("}")
    return "\n".join(out) + "\n" + _IMPORTER
