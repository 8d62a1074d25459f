"""The documents: the README's set-up is what CI runs, the documentation site's command-line synopsis and API
table match the code, and the site builds strictly (broken links and missing references fail)."""
import argparse
import importlib
import re
from pathlib import Path

import attngen
from attngen.tools.cli import build_parser

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"


def test_readme_set_up_is_what_ci_runs_and_says_how_to_get_the_cpu_build():
    """The README's two set-up commands are the ones .ci/run executes (in a fresh venv), and the set-up says to
    make a venv and how to get torch's CPU build where pip would otherwise fetch the CUDA one."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Set-up\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    commands = [line for line in blocks[0].splitlines() if line.strip()]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands == ['pip install torch==2.13.0 ".[test]" && attngen build specs/causal.attn --target h100', "python -m pytest -n auto"]
    assert commands[0] in ci and commands[1] in ci
    assert "python3 -m venv" in "\n".join(ci) and "python -m venv .venv && . .venv/bin/activate" in section
    assert any("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in b for b in blocks[1:])


def _synopsis() -> dict[str, str]:
    """The command-line page's synopsis (docs/cli.md, its first plain code block): each line's command (or
    --version) -> the line, comment dropped."""
    block = re.search(r"```\n(.*?)```", (DOCS / "cli.md").read_text(), re.S).group(1)
    return {line.split()[1]: line.split("#", 1)[0].rstrip() for line in block.splitlines() if line.startswith("attngen ")}


def _options(line: str) -> dict[str, bool]:
    """Each option a synopsis line shows -> whether it is required (first shown outside brackets)."""
    found, depth = {}, 0
    for m in re.finditer(r"\[|\]|(?<![\w-])(--?[a-z][\w-]*)", line):
        if m.group() == "[":
            depth += 1
        elif m.group() == "]":
            depth -= 1
        else:
            found.setdefault(m.group(1), depth == 0)
    return found


def test_cli_page_synopsis_matches_the_parser():
    """Every option of every command is in the command-line page's synopsis (by one of its spellings), marked optional unless
    it is required, and the synopsis shows nothing the parser does not take."""
    parser = build_parser()
    synopsis = _synopsis()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(synopsis) == set(commands.choices) | {"--version"}
    assert _options(synopsis["--version"]) == {"--version": True}
    for name, sub in commands.choices.items():
        shown = _options(synopsis[name])
        actions = [a for a in sub._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
        for action in actions:
            spelled = [opt for opt in action.option_strings if opt in shown]
            assert len(spelled) == 1, f"attngen {name}: docs/cli.md shows {action.option_strings} {len(spelled)} times"
            assert shown[spelled[0]] == action.required, f"attngen {name} {spelled[0]}: required is {action.required}"
        assert set(shown) <= {opt for a in actions for opt in a.option_strings}, f"attngen {name}: docs/cli.md shows an unknown option"


def test_python_api_page_links_every_public_name_to_its_reference():
    """Each name attngen exports (and attngen.hf.register) has a row in the Python API page's table that links its
    entry in the API reference, and each such entry is documented there: a `::: path` directive of the reference
    page, or a member listed under the directive of its module."""
    page = (DOCS / "python-api.md").read_text()
    links = dict(re.findall(r"\[(attngen\.[\w.]+)\]\(reference\.md#([\w.]+)\)", page))
    names = {f"attngen.{n}" for n in attngen.__all__} | {"attngen.hf.register"}
    assert names <= set(links), sorted(names - set(links))
    reference = (DOCS / "reference.md").read_text()
    documented = set()
    for path, options in re.findall(r"^::: ([\w.]+)\n((?:    .*\n)*)", reference, re.M):
        documented.add(path)
        members = re.search(r"members: \[([^\]]*)\]", options)
        documented |= {f"{path}.{m.strip()}" for m in members.group(1).split(",")} if members else set()
    assert set(links.values()) <= documented, sorted(set(links.values()) - documented)
    for name, anchor in links.items():  # the anchor names the very object attngen exports under that name
        assert _resolve(anchor) is _resolve(name), (name, anchor)


def _resolve(path: str):
    """The object a dotted path names: its longest importable module prefix, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)
