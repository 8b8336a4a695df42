"""No module of flaxlm imports, directly or through others, a module that imports it back.

Checked on the source with `ast`, counting `from package import name` as an import of the
package itself (it runs the package's `__init__`): import-linter's contracts count it as an
import of the module `package.name` only, and so miss a package whose `__init__` imports the
very module that imports it (`flaxlm.tasks` ↔ `flaxlm.tasks.clm`)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The flaxlm modules `path` imports: each `import X` and `from X import ...` names X, and
    `from X import Y` also X.Y where that is a module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found & modules - {module_name(path)}


def test_no_module_reaches_itself_through_its_imports():
    paths = [p for p in (SRC / "flaxlm").rglob("*.py") if "conf" not in p.parts]
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): imports_of(p, modules) for p in paths}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            module = todo.pop()
            if module == goal:
                return True
            if module not in seen:
                seen.add(module)
                todo.extend(graph[module])
        return False

    cycles = [(module, imported) for module in sorted(graph)
              for imported in sorted(graph[module]) if reaches(imported, module)]
    assert cycles == []
