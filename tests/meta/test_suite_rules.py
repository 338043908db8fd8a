"""Rules the test suite keeps (issue 13), checked on its source: tests get shared set-up from
conftest's fixtures, never by importing conftest or each other; no ``__import__``; no state on a
class or a module that one test changes and the next one sees."""

import ast
import re
from pathlib import Path

TESTS = Path(__file__).parents[1]
TEST_MODULES = sorted(TESTS.rglob("test_*.py"))
SCRIPTS = sorted((TESTS / "scripts").glob("*.py"))
EVERY_FILE = TEST_MODULES + [TESTS / "conftest.py"] + SCRIPTS
MUTABLE_CALLS = {"list", "dict", "set", "defaultdict", "deque", "OrderedDict", "Counter"}
MUTATING_METHODS = {"append", "extend", "insert", "remove", "pop", "clear", "update", "add", "discard",
                    "setdefault", "popitem"}
# Spelled in pieces so that this file does not match what it looks for.
CONFTEST_IMPORT = re.compile(r"^\s*(from\s+conftest\s+import|import\s+conftest)\b", re.MULTILINE)
DUNDER_IMPORT = "__" + "import__"


def _id(path: Path) -> str:
    return str(path.relative_to(TESTS))


def _source(path: Path) -> str:
    return path.read_text()


def test_nothing_imports_conftest():
    """Not as code, not inside a code string run in a subprocess: conftest is pytest's to load."""
    found = {_id(p): m.group(0).strip() for p in TEST_MODULES + SCRIPTS for m in CONFTEST_IMPORT.finditer(_source(p))}
    assert found == {}, f"these import conftest; ask for its fixtures by name (scripts: tiny_setup): {found}"


def _imported_modules(path: Path) -> set[str]:
    imported = set()
    for node in ast.walk(ast.parse(_source(path))):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                imported.add(arg.value.split(".")[0])
    return imported


def test_no_module_imports_a_test_module():
    test_names = {p.stem for p in TEST_MODULES}
    found = {_id(p): sorted(_imported_modules(p) & test_names) for p in EVERY_FILE}
    assert {k: v for k, v in found.items() if v} == {}


def test_no_dunder_import():
    # this file is left out: it names what it looks for
    found = [_id(p) for p in EVERY_FILE if p.name != Path(__file__).name and DUNDER_IMPORT in _source(p)]
    assert found == [], f"these use {DUNDER_IMPORT}; use a plain import"


def _is_mutable(value: ast.expr) -> bool:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    return isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", None)) in MUTABLE_CALLS


def _assigned(node: ast.AST):
    if isinstance(node, ast.Assign):
        return node.targets, node.value
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target], node.value
    return [], None


def class_state_problems(tree: ast.Module) -> list[str]:
    """Mutable values in class bodies, and class attributes assigned from outside the class body
    (``SomeTrainer.flag = ...`` in a test or a method): both live as long as the class."""
    classes = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    problems = []
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        for stmt in cls.body:
            targets, value = _assigned(stmt)
            if value is not None and _is_mutable(value):
                problems.append(f"line {stmt.lineno}: class {cls.name} holds a mutable value")
    for node in ast.walk(tree):
        for target in _assigned(node)[0]:
            for part in ast.walk(target):
                if (isinstance(part, ast.Attribute) and isinstance(part.ctx, ast.Store)
                        and isinstance(part.value, ast.Name) and part.value.id in classes):
                    problems.append(f"line {node.lineno}: assigns {part.value.id}.{part.attr} on the class")
    return problems


def module_state_problems(tree: ast.Module) -> list[str]:
    """Module-level lists, dicts and sets that a function changes (or rebinds through ``global``)."""
    mutable = set()
    for stmt in tree.body:
        targets, value = _assigned(stmt)
        if value is not None and _is_mutable(value):
            mutable |= {t.id for t in targets if isinstance(t, ast.Name)}
    problems = []
    for func in (node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for node in ast.walk(func):
            if isinstance(node, ast.Global):
                problems.append(f"line {node.lineno}: {func.name} declares global {', '.join(node.names)}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in MUTATING_METHODS and isinstance(node.func.value, ast.Name)
                  and node.func.value.id in mutable):
                problems.append(f"line {node.lineno}: {func.name} changes module-level {node.func.value.id}")
            elif isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, (ast.Store, ast.Del)):
                base = node.value
                if isinstance(base, ast.Name) and base.id in mutable:
                    problems.append(f"line {node.lineno}: {func.name} changes module-level {base.id}")
    return problems


def test_no_state_on_a_class_or_a_module_carries_from_test_to_test():
    found = {}
    for path in TEST_MODULES + [TESTS / "conftest.py"]:
        tree = ast.parse(_source(path))
        found[_id(path)] = class_state_problems(tree) + module_state_problems(tree)
    assert {k: v for k, v in found.items() if v} == {}


def test_the_checks_catch_what_they_look_for():
    """Each rule on a small module that breaks it (so a check that finds nothing still works)."""
    carried = ast.parse(
        "class Recorder:\n"
        "    seen = []\n"
        "def test_a():\n"
        "    Recorder.flag = 1\n"
        "SEEN = {}\n"
        "def test_b():\n"
        "    SEEN['x'] = 1\n"
        "    SEEN.update(y=2)\n"
    )
    assert len(class_state_problems(carried)) == 2
    assert len(module_state_problems(carried)) == 2
    clean = ast.parse(
        "class Trainer:\n"
        "    at_step = 1\n"
        "    def step(self):\n"
        "        self.seen = []\n"
        "CASES = [1, 2]\n"
        "def test_c():\n"
        "    local = dict(CASES=CASES)\n"
        "    local['x'] = 1\n"
    )
    assert class_state_problems(clean) == [] and module_state_problems(clean) == []
    assert CONFTEST_IMPORT.search("x = 1\n    from conftest import tiny_config\n")
    assert CONFTEST_IMPORT.search("import conftest\n") and not CONFTEST_IMPORT.search("# see conftest's fixtures\n")


# Folders that group tests by what they exercise, beside the folders that mirror package folders.
MATH_MODULES = {"advantages", "functional", "losses", "kl_control", "gradients", "estimators", "estimator_table",
                "critic_baselines", "off_policy"}
GROUPS = {
    "math": "the pure tensor modules (each file named for one of MATH_MODULES)",
    "trainer": "PPOTrainer's own behaviour, phase by phase (test_trainer*.py)",
    "end_to_end": "whole runs: the examples, the launches, the conformance matrix, TRL-style scripts",
    "benchmarks": "the benchmarks under benchmarks/ (each file named for one of them)",
    "meta": "the suite's own rules, the docs, the import graph, the doctests",
}


def test_the_test_folders_mirror_the_package_folders():
    """A newcomer finds a module's tests where the module is: ``tests/<folder>/`` holds the tests of
    ``trl_ppo_ext/<folder>/`` (``tests/rewards/test_remote.py`` tests ``rewards/remote.py``); the
    groups in ``GROUPS`` hold the math, the trainer, the end-to-end runs, the benchmarks and the
    suite's own rules; the other flat modules' tests sit in ``tests/`` itself; and no folder of tests
    is left without its package folder or group."""
    package = TESTS.parent / "trl_ppo_ext"
    package_folders = {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}
    test_folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name not in {"scripts", "__pycache__"}}
    assert test_folders == package_folders | set(GROUPS)
    flat_modules = {p.stem for p in package.glob("*.py")}
    benchmarks = {p.stem for p in (TESTS.parent / "benchmarks").iterdir() if p.suffix == ".py" or p.is_dir()}
    assert MATH_MODULES <= flat_modules
    named_for = {"math": MATH_MODULES, "trainer": {"trainer"}, "benchmarks": benchmarks}
    for folder in test_folders - {"end_to_end", "meta"}:
        # each file is named for a module of its folder, or (generation/) for the vLLM engines and
        # the generation layer as a whole
        named = named_for.get(folder) or {p.stem for p in (package / folder).glob("*.py")} | {"generation", "vllm"}
        names = [p.stem[len("test_"):] for p in (TESTS / folder).glob("test_*.py")]
        assert names, folder
        strays = [n for n in names if not any(n == m or n.startswith(m + "_") for m in named)]
        assert strays == [], f"tests/{folder}: {strays} name nothing of {sorted(named)}"
