"""Docs that cannot rot: every command in README.md and docs/ is checked, every relative link and
anchor resolves, and the benchmark tables are what bench/results/ generates.

Each command of a ```bash block is classified by `check_command`:
- a run on a tiny config (`bash launch/demo.sh`, `python -m dapo_megatron.main --config-name
  quickstart*`): its command without overrides is a key of tests/doc_runs.py's DOC_RUNS, whose
  end-to-end test builds its command line from `doc_args(key)`; its overrides go through the real
  config loader;
- a cluster command (a 30B config, a launch script): the config with its overrides resolved by
  the real loader (`load_config`: translation of verl keys, typing, every rule), the memory plan
  run on it, every script and repository path it names present;
- the other CLIs (convert, evaluate, tools, assets): their arguments parsed by their own parsers;
- bench / dev scripts: present, with each `--flag` one the script defines; Ray, pip, git and the
  shell's own commands: accepted, their inner command checked (`ray job submit -- ...`).
Anything else fails, naming the page and line.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import importlib
import importlib.util
import io
import os
import re
import shlex
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)

from tests.doc_runs import DOC_RUNS, normalize  # noqa: E402

REPO_DIRS = ("launch", "configs", "bench", "dev", "docs", "tests", "dapo_megatron", "checkpoint_tools")
SHELL_LANGS = {"bash", "sh", "shell"}
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)[^\n]*$")
OVERRIDE = re.compile(r"^\+{0,2}~?[A-Za-z_][\w.@/-]*=")
ACCEPTED = {"pip", "git", "cd", "export", "source", "mkdir", "tensorboard", "vllm", "ls", "cat", "du", "tail", "ray"}
RAY_SUBCOMMANDS = {"start", "stop", "status", "job"}


def pages() -> list[str]:
    found = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in
                                   glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    return found


def read(page: str) -> str:
    with open(os.path.join(ROOT, page)) as f:
        return f.read()


def blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """(language, first line number, lines) of each fenced block."""
    out, lang, start, body, fence = [], None, 0, [], ""
    for i, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if lang is None and m:
            lang, start, body, fence = m.group(3).lower(), i + 1, [], m.group(2)
        elif lang is not None and line.strip().startswith(fence) and line.strip().strip(fence[0]) == "":
            out.append((lang, start, body))
            lang = None
        elif lang is not None:
            body.append(line)
    return out


def commands(lines: list[str], first: int) -> list[tuple[int, list[str]]]:
    """(line number, words) of each command: continuations joined, comments dropped, split at
    `&&`, `||` and `;`."""
    out, pending, at = [], "", first
    for i, line in enumerate(lines):
        if not pending:
            at = first + i
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text, pending = pending + line, ""
        lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split, lexer.commenters = True, "#"
        words: list[str] = []
        for w in lexer:
            if w in (";", "&&", "||", "&"):
                if words:
                    out.append((at, words))
                words = []
            else:
                words.append(w)
        if words:
            out.append((at, words))
    return out


# ---- the checks of one command ------------------------------------------------------------

def _repo_paths(words: list[str]) -> list[str]:
    missing = []
    for w in words:
        value = w.split("=", 1)[1] if OVERRIDE.match(w) else w
        for part in re.split(r"[\[\],:]", value):
            part = part.strip("'\"")
            if part.split("/", 1)[0] in REPO_DIRS and "/" in part and not any(c in part for c in "*$<{"):
                if not os.path.exists(os.path.join(ROOT, part)):
                    missing.append(part)
    return missing


def _load(config: str, overrides: list[str]):
    from dapo_megatron.config import load_config
    return load_config(config, overrides)


@contextlib.contextmanager
def _parse_only():
    """`ArgumentParser.parse_args` parses, then stops the command before it does anything."""
    original = argparse.ArgumentParser.parse_args

    class Parsed(Exception):
        pass

    def parse(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed()

    argparse.ArgumentParser.parse_args = parse
    try:
        yield Parsed
    finally:
        argparse.ArgumentParser.parse_args = original


def _parse_cli(module: str, argv: list[str]) -> str | None:
    """A command of ours other than main and plan (convert, evaluate, tools, assets, data
    builders, checkpoint_tools): its own parser takes the arguments."""
    try:
        mod = importlib.import_module(module)
        if not hasattr(mod, "main") and importlib.util.find_spec(module + ".__main__"):
            mod = importlib.import_module(module + ".__main__")
    except ImportError as exc:
        return f"python -m {module}: {exc}"
    if not hasattr(mod, "main"):
        return f"python -m {module}: no main(argv)"
    err = io.StringIO()
    with _parse_only() as parsed, contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            mod.main(argv)
        except parsed:
            return None
        except SystemExit:
            return f"python -m {module}: its parser refuses the arguments: {err.getvalue().strip().splitlines()[-1:]}"
    return f"python -m {module}: ran without parsing arguments"


def _split_main(argv: list[str]) -> tuple[str, list[str], list[str]]:
    """(config name, leading words up to the first override, the overrides)."""
    from dapo_megatron.main import parse_args
    args = parse_args(argv)
    head = [w for w in argv if w not in args.overrides]
    return args.config_name, head, list(args.overrides)


def _check_run(config: str, base: str, overrides: list[str]) -> str | None:
    if config.startswith("quickstart"):
        if base not in DOC_RUNS:
            return (f"{base!r} runs on the tiny assets but is not in tests/doc_runs.py's DOC_RUNS "
                    "(map it to the end-to-end test that runs it)")
    try:
        _load(config, overrides)
    except Exception as exc:  # ConfigError names the key
        return f"config {config} with {' '.join(overrides)}: {exc}"
    return None


def _check_plan(argv: list[str]) -> str | None:
    from dapo_megatron.plan.__main__ import main as plan
    if "--build" in argv:  # the meta-device build (~25 s a config) runs in tests/unit/test_plan_build.py
        return _parse_cli("dapo_megatron.plan", argv)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = plan(argv)
    if rc not in (0, 1):  # 1: the plan does not fit, which a page may show
        return f"python -m dapo_megatron.plan {' '.join(argv)}: exit {rc}: {err.getvalue().strip()}"
    return None


def _script_config(script: str) -> str | None:
    # CONFIG="${CONFIG:-name}" (overridable), or CONFIG=name set for a script it calls (the VL ones)
    m = re.search(r'CONFIG="\$\{CONFIG:-(\w+)\}"', read(script)) or re.search(r'^CONFIG=(\w+)\s', read(script), re.M)
    return m.group(1) if m else None


def _check_script_flags(script: str, args: list[str]) -> str | None:
    source = read(script)
    for a in args:
        flag = a.split("=", 1)[0]
        # literal flags, or ones a loop adds as f"--{name}" over a table of names (bench/offload.py)
        if flag.startswith("--") and f'"{flag}"' not in source and f"'{flag}'" not in source \
                and not (re.search(r'f"--\{\w+\}"', source) and f'"{flag[2:]}"' in source):
            return f"{script} defines no flag {flag}"
    return None


def check_command(words: list[str]) -> str | None:
    """None if the command is good, else what is wrong with it."""
    env = {}
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    if not words:
        return None
    missing = _repo_paths(words)
    if missing:
        return f"no such file in the repository: {', '.join(missing)}"
    cmd, args = words[0], words[1:]
    if cmd.endswith("/python") or cmd in ("python", "python3"):
        if args[:2] == ["-m", "dapo_megatron.main"]:
            config, head, overrides = _split_main(args[2:])
            return _check_run(config, normalize(shlex.join(["python", "-m", "dapo_megatron.main", *head])
                                                .replace(" --print-config", "")), overrides)
        if args[:2] == ["-m", "dapo_megatron.plan"]:
            return _check_plan(args[2:])
        if len(args) >= 2 and args[0] == "-m" and args[1].startswith("dapo_megatron."):
            return _parse_cli(args[1], args[2:])
        if args and re.match(r"^checkpoint_tools/\w+\.py$", args[0]):
            return _parse_cli(args[0][:-3].replace("/", "."), args[1:])
        if args and re.match(r"^(bench|dev)/\w+\.py$", args[0]):
            return _check_script_flags(args[0], args[1:])
        return f"not a documented kind of python command: {shlex.join(words)}"
    if cmd == "bash":
        if not args or not args[0].startswith("launch/"):
            return f"bash runs a script of launch/: {shlex.join(words)}"
        script, rest = args[0], args[1:]
        if script == "launch/demo.sh":
            return _check_run("quickstart", "bash launch/demo.sh", rest)
        if script in ("launch/run_tests.sh", "launch/setup_env.sh"):
            return None
        config = env.get("CONFIG") or _script_config(script)
        if config is None:
            return f"{script} names no CONFIG"
        return _check_run(config, f"bash {script}", rest)
    if cmd == "ray":
        if not args or args[0] not in RAY_SUBCOMMANDS:
            return f"ray {args[:1]}: not a documented ray command"
        if args[:2] == ["job", "submit"]:
            if "--" not in args:
                return "ray job submit without `-- <command>`"
            inner = args[args.index("--") + 1:]
            if inner[:2] == ["bash", "-c"]:
                return None
            return check_command(inner)
        return None
    if cmd in ACCEPTED:
        return None
    return f"not a documented kind of command: {shlex.join(words)}"


# ---- links -------------------------------------------------------------------------------

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def slug(heading: str) -> str:
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(text).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            out.add(s if n == 0 else f"{s}-{n}")
            seen[s] = n + 1
    out |= set(re.findall(r'<a (?:name|id)="([^"]+)"', text))
    return out


def _prose(text: str) -> str:
    """The text without fenced blocks (their lines blanked, so line numbers stay)."""
    out, inside, fence = [], False, ""
    for line in text.splitlines():
        m = FENCE.match(line)
        if not inside and m:
            inside, fence = True, m.group(2)
            out.append("")
        elif inside:
            if line.strip().startswith(fence) and line.strip().strip(fence[0]) == "":
                inside = False
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def broken_links(page: str) -> list[str]:
    text = read(page)
    bad = []
    prose = re.sub(r"`[^`\n]*`", "", _prose(text))
    for i, line in enumerate(prose.splitlines(), 1):
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(os.path.join(ROOT, dest)):
                bad.append(f"{page}:{i}: {target}: no file {dest}")
            elif anchor and dest.endswith(".md") and anchor not in anchors(read(dest)):
                bad.append(f"{page}:{i}: {target}: {dest} has no heading #{anchor}")
    return bad


# ---- the tests ---------------------------------------------------------------------------

def all_commands() -> list[tuple[str, list[str]]]:
    out = []
    for page in pages():
        for lang, first, lines in blocks(read(page)):
            if lang in SHELL_LANGS:
                out += [(f"{page}:{line}", words) for line, words in commands(lines, first)]
    return out


def test_every_documented_command_checks_out(monkeypatch):
    monkeypatch.chdir(ROOT)
    found = all_commands()
    assert len(found) >= 20, "the docs' commands were not found: is the block syntax still ```bash?"
    places: dict[tuple[str, ...], list[str]] = {}
    for where, words in found:  # a command shown on several pages is checked once
        places.setdefault(tuple(words), []).append(where)
    bad = []
    for words, where in places.items():
        problem = check_command(list(words))
        if problem:
            bad.append(f"{', '.join(where)}: {problem}")
    assert not bad, "\n".join(bad)


def test_every_relative_link_and_anchor_resolves():
    bad = [b for page in pages() for b in broken_links(page)]
    assert not bad, "\n".join(bad)


def test_benchmark_tables_are_generated_from_results():
    import render
    generated = render.render()
    stale = render.stale(generated)
    assert not stale, f"out of date (run python bench/render.py): {stale}"


def test_each_documented_run_is_run_by_its_test():
    for command, (args, test_file) in DOC_RUNS.items():
        source = read(test_file)
        assert f'doc_args("{command}")' in source, f"{test_file} does not run {command!r} (doc_args)"
        assert normalize(command) == command


def test_readme_is_a_front_door():
    text = read("README.md")
    assert len(text.splitlines()) <= 200
    prose = _prose(text)
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", prose), "a date in README.md"
    hashes = [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", prose) if re.search(r"\d", h) and re.search(r"[a-f]", h)]
    assert not hashes, f"commit hashes in README.md: {hashes}"
    shell = [words for lang, first, lines in blocks(text) if lang in SHELL_LANGS
             for _, words in commands(lines, first)]
    assert shell[:2] == [["bash", "launch/demo.sh"], ["bash", "launch/run_tests.sh"]], \
        "README's first commands are the two set-up commands (demo, tests)"


# ---- the checks can fail ------------------------------------------------------------------

@pytest.mark.parametrize("command, why", [
    ("python -m dapo_megatron.main --config-name qwen3_30b_a3b_megatron_gpu actor.clip_ratio_hgh=0.3", "clip_ratio_hgh"),
    ("python -m dapo_megatron.main --config-name quickstart_nope", "quickstart_nope"),
    ("bash launch/30B_megatron_dapo_nope.sh", "launch/30B_megatron_dapo_nope.sh"),
    ("python -m dapo_megatron.convert hf-to-mcore --no-such-flag 1", "parser refuses"),
    ("python bench/render.py --no-such-flag", "--no-such-flag"),
    ("ray job submit --address http://HEAD:8265 -- python -m dapo_megatron.main --config-name dapo data.nope=1", "data.nope"),
    ("curl http://example.com", "not a documented kind"),
    ("python -m dapo_megatron.plan --config-name qwen3_30b_a3b_megatron_npu actor.parallel.tp=3", "exit 2"),
])
def test_a_bad_command_is_named(command, why, monkeypatch):
    monkeypatch.chdir(ROOT)
    problem = check_command(shlex.split(command))
    assert problem and why in problem, problem


def test_a_broken_anchor_is_named(tmp_path, monkeypatch):
    page = "docs/_probe.md"
    path = os.path.join(ROOT, page)
    with open(path, "w") as f:
        f.write("# Probe\n\n## A section\n\n[ok](#a-section) [bad](#no-section) [file](nope.md) `[code](x.md)`\n")
    try:
        bad = broken_links(page)
    finally:
        os.remove(path)
    assert len(bad) == 2 and "#no-section" in bad[0] and "nope.md" in bad[1], bad
