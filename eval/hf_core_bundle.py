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
   working, private names of different modules stay in their own modules, and two folders exported
   from different versions of the core load side by side in one process.

Tracebacks from the embedded code name the original file (e.g. `smlp/lm.py`) and show its lines (the
importer is the modules' `__loader__` and answers `get_source`).
"""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CoreModule", "BundleError", "core_modules", "bundle_source", "bundle_package", "ALLOWED_EXTERNAL"]

ROOT_PACKAGE = "smlp"
# Imports the embedded core may make besides the standard library: what transformers needs anyway.
ALLOWED_EXTERNAL = ("torch", "numpy")


class BundleError(ValueError):
    """The core cannot be packed (a module not found as source, an import outside the allowed ones)."""


@dataclass(frozen=True)
class CoreModule:
    name: str          # e.g. "smlp.lm", "smlp.routing.gates"
    source: str
    is_package: bool   # an __init__.py
    path: str          # where it was read, relative to the folder holding the `smlp` package

    @property
    def relative(self) -> str:
        """The name inside the package: "" for `smlp` itself, "lm", "routing.gates"."""
        return self.name[len(ROOT_PACKAGE) + 1:] if self.name != ROOT_PACKAGE else ""


def _is_core(name: str) -> bool:
    return name == ROOT_PACKAGE or name.startswith(ROOT_PACKAGE + ".")


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
                          f"{ROOT_PACKAGE} package")
    base = ".".join(parts[:len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def _imports(module: CoreModule) -> tuple[set[str], set[tuple[str, int]]]:
    """(core modules `module` imports, (external top-level name, line) pairs)."""
    core, external = set(), set()
    for node in ast.walk(ast.parse(module.source, module.path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                (core.add(alias.name) if _is_core(alias.name) else external.add((alias.name.split(".")[0],
                                                                                  node.lineno)))
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            if not _is_core(target):
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
    """`root` and every core module it needs, in name order (see the module docstring)."""
    if not _is_core(root):
        raise BundleError(f"{root} is not a module of the {ROOT_PACKAGE} package")
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
    return f"_{ROOT_PACKAGE}_core_{digest.hexdigest()[:16]}"


_IMPORTER = '''
class _EmbeddedCore(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """Imports the embedded smlp modules (_CORE_SOURCES) as the package _CORE_PACKAGE."""

    def __init__(self, package, sources):
        self.package, self.sources = package, sources

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
        spec = importlib.util.spec_from_loader(fullname, self, origin=entry[1], is_package=entry[0])
        spec.has_location = False
        return spec

    def is_package(self, fullname):
        return self._entry(fullname)[0]

    def get_source(self, fullname):
        return "\\n".join(self._entry(fullname)[2]) + "\\n"

    def get_code(self, fullname):
        return compile(self.get_source(fullname), self._entry(fullname)[1], "exec", dont_inherit=True)


def _import_core(module):
    """The embedded core module `module` (e.g. "lm"), registering the package on first use."""
    if not any(getattr(f, "package", None) == _CORE_PACKAGE for f in sys.meta_path):
        sys.meta_path.append(_EmbeddedCore(_CORE_PACKAGE, _CORE_SOURCES))
    return importlib.import_module(f"{_CORE_PACKAGE}.{module}" if module else _CORE_PACKAGE)
'''


def bundle_source(modules: list[CoreModule]) -> str:
    """Python source defining _CORE_PACKAGE, _CORE_SOURCES and `_import_core(relative_name)`."""
    package = bundle_package(modules)
    out = ["import importlib", "import importlib.abc", "import importlib.util", "import sys", "",
           f"_CORE_PACKAGE = {package!r}",
           "# relative module name -> (is a package, file it was read from, its lines)",
           "_CORE_SOURCES = {"]
    for m in modules:
        out.append(f"    {m.relative!r}: ({m.is_package!r}, {m.path!r}, (")
        out += [f"        {line!r}," for line in m.source.split("\n")[:-1 if m.source.endswith("\n") else None]]
        out.append("    )),")
    out.append("}")
    return "\n".join(out) + "\n" + _IMPORTER
