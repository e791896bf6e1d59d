"""The package's shape (issue 21): one module per concept, imports that go one way, no private reaches,
no copy-paste, and a README chapter table that names every engine module."""

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vllmini"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60
NAMEDTUPLE_API = {
    "_replace",
    "_asdict",
    "_fields",
    "_make",
}  # public, despite the underscore  # longer only with a `# long: <why>` comment on the line above the def


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def is_engine(name: str) -> bool:
    """The engine: vllmini's modules outside the course's tools and the CPU emulator."""
    return not name.startswith(("vllmini.course", "vllmini.emulator"))


def resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imports(module: str):
    """(imported module, imported name or None, line) for every import in `module`, at any depth."""
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            source = resolve(module, node)
            for alias in node.names:
                # `from vllmini import allocator` imports a module, not a name
                if f"{source}.{alias.name}" in MODULES:
                    yield f"{source}.{alias.name}", None, node.lineno
                else:
                    yield source, alias.name, node.lineno


def graph() -> dict[str, set[str]]:
    edges = defaultdict(set)
    for module in MODULES:
        for target, _, _ in imports(module):
            if target in MODULES and target != module and module != "vllmini":
                edges[module].add(target)
    return edges


def test_imports_have_no_cycles():
    edges, state, cycles = graph(), {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for module in sorted(MODULES):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_private_name_is_imported_across_modules():
    reaches = [
        f"{module}:{line} imports {name} from {source}"
        for module in MODULES
        for source, name, line in imports(module)
        if source.startswith("vllmini") and name and name.startswith("_") and not name.startswith("__")
    ]
    assert not reaches, "\n".join(reaches)


def test_no_module_reads_another_objects_private_fields():
    """`x._field` is read only through `self`/`cls` (or an object of the same class, inside that class)."""
    reaches = []
    for module, tree in TREES.items():
        own = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        # another library's module (ctypes._SimpleCData) is that library's business, not a reach
        own |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "vars" and node.args:
                if not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self"):
                    reaches.append(f"{module}:{node.lineno} vars() of another object")
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")):
                continue
            if node.attr.startswith("__") and node.attr.endswith("__") or node.attr in NAMEDTUPLE_API:
                continue
            base = node.value
            if isinstance(base, ast.Name) and (base.id in {"self", "cls", "other"} | own):
                continue
            reaches.append(f"{module}:{node.lineno} reads .{node.attr} of {ast.unparse(base)}")
    assert not reaches, "\n".join(reaches)


def test_the_engine_never_imports_the_course():
    bad = [
        f"{module}:{line} imports {source}"
        for module in MODULES
        if is_engine(module) and module != "vllmini"
        for source, _, line in imports(module)
        if source.startswith("vllmini.course")
    ]
    assert not bad, "\n".join(bad)


def test_only_the_package_root_re_exports():
    """A module may not hand on names it imported (`__all__` listing them, or a `noqa: F401` import), nor
    keep old import paths alive with a module `__getattr__`."""
    bad = []
    for module, tree in TREES.items():
        if module == "vllmini":
            continue
        lines = MODULES[module].read_text().splitlines()
        for node in tree.body:  # an unused import at module level is there to be imported from here
            if isinstance(node, (ast.Import, ast.ImportFrom)) and "F401" in "".join(
                lines[node.lineno - 1 : node.end_lineno]
            ):
                bad.append(f"{module}:{node.lineno} re-exports (noqa: F401)")
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in ("__getattr__", "__dir__"):
                bad.append(f"{module}: module {node.name} (a compatibility shim)")
    assert not bad, "\n".join(bad)


def _normalized(node: ast.FunctionDef) -> str:
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    clone = ast.Module(body=[ast.parse(ast.unparse(stmt)).body[0] for stmt in body], type_ignores=[])
    for sub in ast.walk(clone):
        for field in ("id", "arg", "attr", "name"):
            if isinstance(getattr(sub, field, None), str):
                setattr(sub, field, "_")
        if isinstance(sub, ast.Constant):
            sub.value = type(sub.value).__name__
    return ast.dump(clone, include_attributes=False)


def test_no_two_functions_are_copies():
    """No copy-paste left: two functions whose bodies are the same once names and constants are
    blanked out (bodies of at least five lines; shorter ones are one-liners that may rhyme)."""
    seen = defaultdict(list)
    for module, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[1:] if ast.get_docstring(node) is not None else node.body
                if body and body[-1].end_lineno - body[0].lineno + 1 >= 5:
                    seen[_normalized(node)].append(f"{module}:{node.lineno} {node.name}")
    copies = [" == ".join(places) for places in seen.values() if len(places) > 1]
    assert not copies, "functions with the same normalized body:\n" + "\n".join(copies)


def test_modules_and_functions_stay_readable():
    """No module over 600 lines (a concept may need that much, no more); no function over 60 lines
    (docstring included) unless a comment says why."""
    too_long = []
    for name, path in MODULES.items():
        lines = path.read_text().splitlines()
        if len(lines) > MAX_MODULE_LINES:
            too_long.append(f"{name}: {len(lines)} lines")
        for node in ast.walk(TREES[name]):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                explained = lines[first - 2].strip().startswith("# long:")
                if length > MAX_FUNCTION_LINES and not explained:
                    too_long.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, "over the size rules:\n" + "\n".join(too_long)


def test_the_readme_chapter_table_names_every_engine_module():
    """Each engine module is named in the README's chapter table, beside the notebook that builds it."""
    readme = (ROOT / "README.md").read_text()
    table = "\n".join(line for line in readme.splitlines() if line.startswith("| ["))
    named = set(re.findall(r"`vllmini/([a-z_]+)\.py`", table))
    engine = {p.stem for n, p in MODULES.items() if is_engine(n) and p.parent == PACKAGE} - {"__init__"}
    assert engine - named == set(), "engine modules missing from the README's chapter table"
    assert named - engine == set(), "the README's chapter table names modules that do not exist"


def test_the_readme_size_sentence_is_the_plain_count():
    """The README's size sentence ("about N lines of Python in M modules") is scripts/code_size.py's count."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("code_size", ROOT / "scripts" / "code_size.py")
    code_size = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(code_size)
    engine = code_size.sizes()["engine"]
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"The engine is about ([\d,]+) lines of Python in (\d+) modules", readme)
    assert found, "README.md has no size sentence"
    lines, modules = int(found[1].replace(",", "")), int(found[2])
    assert modules == len(engine)
    assert abs(lines - sum(engine.values())) <= 100, (
        f"README says {lines}, the count is {sum(engine.values())}"
    )


def test_the_engine_stays_within_its_size_budget():
    """The engine at most 4,700 lines in at most 20 modules; what notebook 06 builds (the engine modules
    its row of the README's course table names) at most 2,200 lines."""
    engine = {p.stem: p for n, p in MODULES.items() if is_engine(n) and p.parent == PACKAGE}
    total = sum(len(p.read_text().splitlines()) for p in engine.values())
    assert len(engine) <= 20 and total <= 4700, f"{len(engine)} modules, {total} lines"
    readme = (ROOT / "README.md").read_text()
    (row,) = [line for line in readme.splitlines() if line.startswith("| [06_")]
    named = set(re.findall(r"`vllmini/([a-z_]+)\.py`", row))
    chapter = sum(len(engine[m].read_text().splitlines()) for m in named)
    assert chapter <= 2200, f"notebook 06's modules {sorted(named)}: {chapter} lines"
