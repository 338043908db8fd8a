"""README.md and the guides under docs/ as written: every README python snippet runs (or carries an
explicit ``<!-- readme-test: skip (reason) -->`` marker on the line before its fence: a snippet
that needs a hub model or a GPU), every shell command names files and modules that exist, the
example's ``--help`` works, every relative link resolves, and every ``trl_ppo_ext`` name the
docs import or mention exists (a moved module leaves no dead path in the docs)."""

import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
GUIDES = sorted((ROOT / "docs").rglob("*.md"))
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->")
FENCE = re.compile(r"^```(?P<lang>\w*)\s*$")


def code_blocks(path: Path) -> list[tuple[int, str, str, str | None]]:
    """(line of the opening fence, language, code, skip reason) of each fenced block; the reason is read from a
    marker comment on the line right before the opening fence."""
    lines, blocks, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i].strip())
        if m and m.group("lang"):
            marker = SKIP.search(lines[i - 1]) if i else None
            start, body = i + 1, []
            i += 1
            while not lines[i].strip().startswith("```"):
                body.append(lines[i])
                i += 1
            blocks.append((start, m.group("lang"), "\n".join(body), marker and marker.group("reason")))
        i += 1
    return blocks


def test_code_blocks_parser(tmp_path):
    """The parser sees a block's language, body and the skip marker before it."""
    text = "a\n<!-- readme-test: skip (needs a GPU) -->\n```python\nx = 1\n```\n```bash\nls\n```\n"
    path = tmp_path / "check.md"
    path.write_text(text)
    assert code_blocks(path) == [(3, "python", "x = 1", "needs a GPU"), (6, "bash", "ls", None)]


README_PYTHON = [(n, code, reason) for n, lang, code, reason in code_blocks(README) if lang == "python"]


@pytest.mark.parametrize("line,code,reason", README_PYTHON, ids=[f"README.md:{n}" for n, _, _ in README_PYTHON])
def test_readme_python_snippet_runs(line, code, reason, tmp_path, monkeypatch):
    """Each README python block runs as written in a fresh namespace, unless marked with why not."""
    if reason:
        compile(code, f"README.md:{line}", "exec")  # a skipped snippet still has to be valid python
        pytest.skip(f"README.md:{line} is marked: {reason}")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "readme_snippet"})


def test_readme_runs_most_of_its_python():
    """A skip marker is the exception: at most one README snippet (the hub-model example) skips."""
    assert README_PYTHON, "the README has python snippets"
    assert sum(1 for _, _, reason in README_PYTHON if reason) <= 1


def shell_commands(path: Path) -> list[tuple[int, str]]:
    out = []
    for n, lang, code, _ in code_blocks(path):
        if lang in ("bash", "sh", "shell"):
            for k, line in enumerate(code.splitlines()):
                command = line.split(" #")[0].strip()
                if command and not command.startswith("#"):
                    out.append((n + 1 + k, command))
    return out


def _named_paths(command: str) -> list[str]:
    """The files a command names: arguments that look like a path in the repository."""
    words = [w for part in re.split(r"&&|\|\|?|;", command) for w in shlex.split(part)]
    return [w for w in words if not w.startswith(("-", "http", '".', "'.")) and not w.startswith(".[")
            and re.search(r"\.(py|ya?ml|sh|md|json)$|^(examples|tests|benchmarks|docs)/", w)]


README_SHELL = shell_commands(README)


@pytest.mark.parametrize("line,command", README_SHELL, ids=[f"README.md:{n}" for n, _ in README_SHELL])
def test_readme_shell_command_names_what_exists(line, command):
    """Files named by a README command exist; `python -m X` names an importable module."""
    for name in _named_paths(command):
        assert (ROOT / name).exists(), f"README.md:{line}: `{command}` names {name}, which does not exist"
    for module in re.findall(r"python -m ([\w.]+)", command):
        assert importlib.util.find_spec(module) is not None, f"README.md:{line}: no module {module}"


def test_readme_has_the_two_commands_and_safe_install_first():
    """The install line that is safe alone (torch pinned) comes before the package's own line."""
    commands = [c for _, c in README_SHELL]
    assert "accelerate launch examples/ppo_lora.py" in commands
    assert "python -m pytest -q" in commands
    torch_line = next(i for i, c in enumerate(commands) if c.startswith("pip install torch=="))
    package_line = next(i for i, c in enumerate(commands) if c.startswith("pip install -e"))
    assert torch_line < package_line


def test_no_issue_labels_in_user_facing_docs():
    """README, guides, CHANGELOG and the package's sources (whose docstrings are the API reference)
    never say "issue N": the label means nothing to a user."""
    sources = sorted((ROOT / "trl_ppo_ext").rglob("*.py"))
    for path in [README, *GUIDES, ROOT / "CHANGELOG.md", *sources]:
        found = re.findall(r"\b[Ii]ssues? \d+", path.read_text())
        assert not found, f"{path.relative_to(ROOT)}: {found}"


LINK = re.compile(r"\[[^\]]*\]\((?!https?://|mailto:|#)([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("path", [README, *GUIDES], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    missing = [t for t in LINK.findall(path.read_text()) if not (path.parent / t).exists()]
    assert not missing, f"{path.relative_to(ROOT)} links to missing files: {missing}"


# `trl_ppo_ext.a.b` in backticks or in an import line, in the README and every guide.
DOTTED = re.compile(r"\btrl_ppo_ext(?:\.[A-Za-z_]\w*)+")
IMPORT = re.compile(r"^\s*from (trl_ppo_ext[\w.]*) import \(?([\w, ]+)", re.MULTILINE)


def _resolve(dotted: str):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            if importlib.util.find_spec(name) is None:
                continue
        except ModuleNotFoundError:  # a name inside a module, not a submodule
            continue
        obj = importlib.import_module(name)
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def _doc_names() -> dict[str, str]:
    names = {}
    for path in [README, *GUIDES]:
        text = path.read_text()
        where = str(path.relative_to(ROOT))
        for dotted in DOTTED.findall(text):
            names.setdefault(dotted.rstrip("."), where)
        for module, imported in IMPORT.findall(text):
            for name in filter(None, (n.strip() for n in imported.split(","))):
                names.setdefault(f"{module}.{name}", where)
    return names


def test_every_trl_ppo_ext_name_in_the_docs_exists():
    """Module paths and imported names; importing trainer and models takes a few seconds."""
    broken = {}
    for dotted, where in sorted(_doc_names().items()):
        try:
            _resolve(dotted)
        except (ImportError, AttributeError) as error:
            broken[dotted] = f"{where}: {type(error).__name__}: {error}"
    assert not broken, broken


@pytest.mark.slow
def test_example_help_works():
    """`python examples/ppo_lora.py --help`, which the README names, exits 0 and lists the options."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "examples/ppo_lora.py", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--model_name_or_path" in done.stdout and "--load_in_4bit" in done.stdout


def readme_as_docs_home(text: str) -> str:
    """docs/index.md is the README with its links made relative to docs/ (the site's home page)."""
    text = text.replace("](docs/", "](")
    text = text.replace('- API reference: `pip install -e ".[docs]" && mkdocs serve` (sources in `docs/api/`)',
                        "- [API reference](api/index.md), generated from the docstrings")
    text = text.replace("\nChanges are listed in [CHANGELOG.md](CHANGELOG.md).\n",
                        "\nChanges are listed in `CHANGELOG.md` at the top of the repository.\n")
    return re.sub(r"^<!--\s*readme-test:.*-->\n", "", text, flags=re.MULTILINE)


def test_docs_home_is_the_readme():
    """The site's home page and the README say the same: regenerate docs/index.md after a README edit
    with ``readme_as_docs_home`` (this file)."""
    expected = readme_as_docs_home(README.read_text())
    assert (ROOT / "docs" / "index.md").read_text() == expected
