"""The docs cannot rot: README length, links and anchors, code blocks' imports, CLI and make lines, YAML."""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import io
import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import yaml

from policies.loader import parse_policy
from policies.schema import Policy

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 250
DOC_PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]  # their code blocks are checked
LINKED_PAGES = [*DOC_PAGES, ROOT / "ARCHITECTURE.md"]  # their links are checked
SKIP_MARK = "<!-- docs-test: skip -->"
SHELL_LANGS = {"bash", "sh", "shell", "console"}
# A word of a shell line that names a file in the checkout; benchmarks/ is left out: its paths are outputs.
REPO_PATH = re.compile(r"^(?:examples|policies|tests|deployments|flows|supervisor|docs)/[\w./-]+$")
# The smallest valid policy; a YAML block that is one or more policy sections is checked merged into it.
BASE_POLICY = {
    "version": 1,
    "name": "docs-fragment",
    "checkpoint": {"every_steps": 10},
    "rules": [{"when": ["preemption"], "action": "resume", "target": {"select": "latest"}}],
}


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page: its language, text and the line its fence opens on."""

    page: Path
    line: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _prose_and_blocks(page: Path) -> tuple[list[tuple[int, str]], list[Block]]:
    """The page's lines outside code fences (numbered from 1), and its fenced blocks not marked to skip."""
    prose: list[tuple[int, str]] = []
    blocks: list[Block] = []
    fence: tuple[int, str, str] | None = None  # (line, fence, lang) while inside a block
    body: list[str] = []
    skip = False
    last_prose = ""
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        opened = re.match(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)", line)
        if fence is None:
            if opened:
                fence, body, skip = (n, opened.group(1), opened.group(2).lower()), [], last_prose == SKIP_MARK
            else:
                prose.append((n, line))
                if line.strip():
                    last_prose = line.strip()
        elif line.strip().startswith(fence[1]) and not line.strip().strip(fence[1][0]):
            if not skip:
                blocks.append(Block(page, fence[0], fence[2], "\n".join(body) + "\n"))
            fence, last_prose = None, ""
        else:
            body.append(line)
    assert fence is None, f"{page.relative_to(ROOT)}:{fence[0]}: code fence never closed"
    return prose, blocks


def _blocks(langs: set[str]) -> list[Block]:
    return [b for page in DOC_PAGES for b in _prose_and_blocks(page)[1] if b.lang in langs]


def _ids(blocks: list[Block]) -> list[str]:
    return [b.where for b in blocks]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def anchors(page: Path) -> frozenset[str]:
    """Every anchor GitHub makes for the page's headings, with -1, -2, ... on repeats."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_and_blocks(page)[0]:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return frozenset(out)


def _links(page: Path) -> list[tuple[int, str]]:
    """Every Markdown link target in the page's prose (inline code spans are not links)."""
    found = []
    for n, line in _prose_and_blocks(page)[0]:
        text = re.sub(r"`[^`]*`", "", line)
        found += [(n, m.group(1)) for m in re.finditer(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)]
    return found


def test_readme_is_short():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, at most {README_MAX_LINES} allowed: move reference material to docs/"
    )


def test_slug_follows_github():
    assert slug("Sharded checkpoints (FSDP2, DCP)") == "sharded-checkpoints-fsdp2-dcp"
    assert slug("What `lr_scale` changes") == "what-lr_scale-changes"
    assert slug("Quickstart: your own loop") == "quickstart-your-own-loop"
    assert slug("Prefect 3.8 with FastAPI ≥ 0.151") == "prefect-38-with-fastapi--0151"


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_a_file_and_a_heading(page: Path):
    broken = []
    for n, target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{page.name}:{n}: {target}: no file {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{page.name}:{n}: {target}: no heading with anchor #{anchor} in {dest.name}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("block", _blocks({"python", "py"}), ids=_ids(_blocks({"python", "py"})))
def test_python_block_compiles_and_its_imports_run(block: Block):
    code = compile(block.text, block.where, "exec")  # a syntax error fails here, with the page and line
    tree = ast.parse(block.text)
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    for node in imports:
        module = ast.Module(body=[node], type_ignores=[])
        try:
            exec(compile(module, block.where, "exec"), {})
        except ImportError as exc:
            pytest.fail(f"{block.where}: `{ast.unparse(node)}` fails: {exc}")
    assert code is not None


@functools.cache
def cli_help(path: tuple[str, ...]) -> tuple[int, str]:
    """`rollback-supervisor <path> --help`, in process: exit code and text, wide enough that nothing wraps."""
    from supervisor.cli import main

    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, {"COLUMNS": "200"}):
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main([*path, "--help"])
    return rc, out.getvalue() + err.getvalue()


def _is_group(help_text: str) -> bool:
    return re.search(r"^\W*Commands\b", help_text, re.M) is not None


@functools.cache
def make_targets() -> frozenset[str]:
    names = set()
    for line in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-/ ]+?)\s*::?(?!=)", line)
        if m and not line.startswith((".", "\t")):
            names.update(m.group(1).split())
    return frozenset(names)


def shell_commands(block: Block) -> list[tuple[int, list[str]]]:
    """Each command of a shell block as words: continuations joined, `$ ` prompts and comments dropped."""
    commands = []
    pending, start = "", 0
    for n, raw in enumerate(block.text.splitlines(), block.line + 1):
        if not pending:
            start = n
            if block.lang == "console" and not raw.lstrip().startswith("$ "):
                continue  # a console block's output
        line = re.sub(r"^\s*\$ ", "", raw) if not pending else raw
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        words = shlex.split(pending + line, comments=True)
        pending = ""
        while words and re.match(r"^[A-Za-z_]\w*=", words[0]):  # VAR=value before the command
            words.pop(0)
        if words:
            commands.append((start, words))
    return commands


def _check_cli(words: list[str], where: str) -> list[str]:
    """Problems with one `rollback-supervisor ...` line: unknown sub-command or options its help does not list."""
    own = words[1 : words.index("--")] if "--" in words else words[1:]
    path: list[str] = []
    rc, text = cli_help(())
    for word in own:
        if word.startswith("-") or not _is_group(text):
            break
        rc, text = cli_help((*path, word))
        if rc != 0:
            return [f"{where}: `rollback-supervisor {' '.join([*path, word])}` is not a command"]
        path.append(word)
    accepted = set(re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", text))
    flags = [w.split("=", 1)[0] for w in own if w.startswith("--")]
    return [
        f"{where}: `{' '.join(['rollback-supervisor', *path])}` has no option {flag}"
        for flag in flags
        if flag not in accepted
    ]


def _check_paths(words: list[str], where: str) -> list[str]:
    """Problems with the repository files a command line names (scripts, policies, examples)."""
    problems = []
    for word in words:
        value = word.split("=", 1)[1] if word.startswith("--") and "=" in word else word
        if REPO_PATH.match(value) and not (ROOT / value).exists():
            problems.append(f"{where}: {value} does not exist")
    for i, word in enumerate(words[:-1]):
        if word == "-m" and words[0].startswith("python"):
            if importlib.util.find_spec(words[i + 1]) is None:
                problems.append(f"{where}: no module {words[i + 1]} for `python -m`")
    return problems


SHELL_BLOCKS = _blocks(SHELL_LANGS)


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=_ids(SHELL_BLOCKS))
def test_shell_block_commands_exist(block: Block):
    problems = []
    for n, words in shell_commands(block):
        where = f"{block.page.relative_to(ROOT)}:{n}"
        if words[0] == "rollback-supervisor":
            problems += _check_cli(words, where)
        elif words[0] == "make":
            targets = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
            problems += [f"{where}: no Makefile target {t!r}" for t in targets if t not in make_targets()]
        problems += _check_paths(words, where)
    assert not problems, "\n".join(problems)


YAML_BLOCKS = _blocks({"yaml", "yml"})


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=_ids(YAML_BLOCKS))
def test_yaml_block_parses_and_policies_load(block: Block):
    data = yaml.safe_load(block.text)
    assert data is not None, f"{block.where}: the block holds no YAML"
    if isinstance(data, dict) and "version" in data:
        policy = parse_policy(block.text, block.where)  # raises PolicyError naming the key, line and column
        assert policy.name == data.get("name", policy.name)
    elif isinstance(data, dict) and data and set(data) <= set(Policy.model_fields):
        merged = {**BASE_POLICY, **data}
        policy = parse_policy(
            yaml.safe_dump(merged, sort_keys=False), f"{block.where} (merged into a minimal policy)"
        )
        assert all(getattr(policy, key) is not None for key in data), block.where


JSON_BLOCKS = _blocks({"json"})


@pytest.mark.parametrize("block", JSON_BLOCKS, ids=_ids(JSON_BLOCKS))
def test_json_block_parses(block: Block):
    assert isinstance(json.loads(block.text), (dict, list)), f"{block.where}: not a JSON object or array"


def test_the_checks_find_what_they_check():
    """A parser that silently finds nothing would pass every test above."""
    assert len(_blocks({"python"})) >= 3
    assert len(SHELL_BLOCKS) >= 10
    assert len(YAML_BLOCKS) >= 4
    assert any(words[0] == "rollback-supervisor" for b in SHELL_BLOCKS for _, words in shell_commands(b))
    assert {"demo", "test"} <= make_targets()
    assert "quickstart-your-own-loop" in anchors(README)
