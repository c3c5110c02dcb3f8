"""README.md names only commands that exist: every `--flag` is an option of some parser (a corolla command's own
where the README gives it to one), every `make` target is in the Makefile, every `python -m` module and every repository
path it points to is there. A renamed flag or a moved file otherwise leaves the README telling users to type what
fails."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from corolla.cli import api, demo, findings, finetune_demo, generate, health, run_dht, run_server

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

COMMANDS = {
    "corolla-api": api,
    "corolla-demo": demo,
    "corolla-findings": findings,
    "corolla-finetune-demo": finetune_demo,
    "corolla-generate": generate,
    "corolla-health": health,
    "corolla-dht": run_dht,
    "corolla-server": run_server,
}
# `python -m` spellings of the same commands
MODULE_COMMANDS = {"corolla.cli.demo": "corolla-demo", "corolla.cli.finetune_demo": "corolla-finetune-demo"}
# flags of other programs the README's Docker and troubleshooting commands pass (docker, dockerd, nsenter)
FOREIGN_FLAGS = {"--network", "--rm", "--gpus", "--build-arg", "--bridge", "--iptables", "--net"}
FLAG = re.compile(r"(?<![\w-])--[a-zA-Z][\w-]*")


@cache
def command_options(command: str) -> frozenset[str]:
    parser = COMMANDS[command].build_parser()
    return frozenset(s for action in parser._actions for s in action.option_strings)


@cache
def source_options() -> frozenset[str]:
    """Every option string an `add_argument` call of the package or the benchmark programs declares (the
    benchmarks' parsers are built inside their mains, so their sources are read instead)."""
    options: set[str] = set()
    for path in [*(ROOT / "src" / "corolla").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"):
                continue
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            boolean_optional = any(
                k.arg == "action" and getattr(k.value, "attr", None) == "BooleanOptionalAction" for k in node.keywords
            )
            for name in names:
                if name.startswith("--"):
                    options.add(name)
                    if boolean_optional:
                        options.add("--no-" + name[2:])
    return frozenset(options)


def readme() -> str:
    return README.read_text()


def shell_lines() -> list[str]:
    """The README's bash blocks as logical lines (continuations joined, comments cut) and its inline code spans."""
    text = readme()
    lines: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            lines.append(re.sub(r"\s#.*$", "", line))
    lines.extend(re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)))
    return lines


def test_every_flag_the_readme_names_exists_in_some_parser() -> None:
    known = source_options() | FOREIGN_FLAGS
    for command in COMMANDS:
        known |= command_options(command)
    assert sorted(set(FLAG.findall(readme())) - known) == []


def test_each_corolla_command_line_passes_only_its_own_flags() -> None:
    checked = 0
    wrong = []
    for line in shell_lines():
        words = line.split()
        for i, word in enumerate(words):
            command = word if word in COMMANDS else MODULE_COMMANDS.get(word) if i and words[i - 1] == "-m" else None
            if command is None:
                continue
            checked += 1
            options = command_options(command)
            wrong += [(command, flag) for flag in FLAG.findall(" ".join(words[i + 1 :])) if flag not in options]
            break
    assert checked > 20  # the README's command lines were found at all
    assert wrong == []


def test_every_make_target_the_readme_names_exists() -> None:
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
    named = {m for line in shell_lines() for m in re.findall(r"(?:^|\s)make ([a-z][\w-]*)", line)}
    assert named and sorted(named - targets) == []


def test_every_python_module_the_readme_runs_exists() -> None:
    missing = []
    for module in set(re.findall(r"python -m ([a-z_][\w.]*[a-z_])(?![\w.<])", readme())):
        relative = Path(*module.split("."))
        candidates = [relative.with_suffix(".py"), relative / "__main__.py"]
        if not any((base / c).is_file() for base in (ROOT, ROOT / "src") for c in candidates):
            missing.append(module)
    assert sorted(missing) == []


def test_every_repository_path_the_readme_points_to_exists() -> None:
    text = readme()
    paths = set(re.findall(r"`((?:src|docs|benchmarks|tests|docker)/[\w./-]+)`", text))
    paths |= set(re.findall(r"\]\(((?:src|docs|benchmarks|tests|docker)/[\w./-]+)\)", text))
    # benchmarks/results/ is where runs write their raw files: git-ignored, made by the first run
    missing = [p for p in sorted(paths) if p != "benchmarks/results/" and not (ROOT / p).exists()]
    assert paths and missing == []


def test_every_section_link_of_the_readme_names_a_heading() -> None:
    text = readme()
    # GitHub's anchors: the heading lower-cased, punctuation but hyphens dropped, spaces made hyphens
    slugs = {
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M)
    }
    links = set(re.findall(r"\]\(#([\w-]+)\)", text))
    assert links and sorted(links - slugs) == []


def test_every_environment_variable_the_readme_names_is_read_somewhere() -> None:
    sources = "\n".join(
        path.read_text() for folder in ("src", "benchmarks", "tests") for path in (ROOT / folder).rglob("*.py")
    )
    names = set(re.findall(r"\bCOROLLA_[A-Z][A-Z_]*[A-Z]\b", readme()))
    assert names and sorted(name for name in names if name not in sources) == []
