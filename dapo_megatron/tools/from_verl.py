"""Migrate a verl DAPO launch script: print our command (or YAML) and what became of every key.

    python -m dapo_megatron.tools.from_verl run_dapo_qwen2.5_32b.sh [--yaml] [--config-name dapo]

Reads the script's shell variables (`NAME=value`, `${NAME:-default}`, `$((a + b))`, arrays
`NAME=(...)` used as `"${NAME[@]}"`), expands
them into the verl command line (`python3 -m recipe.dapo.main_dapo key=value ...`, or the fully
asynchronous recipe's `fully_async_main`, also behind
`ray job submit ... --`), and resolves each override with `config/verl_compat.py`: translated,
accepted, ignored (with the reason) or refused (with what to do instead). Exit code 0 when every
key resolved, 1 when some were refused (the printed command leaves them out), 2 on bad input.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import time
from typing import Callable

ENTRY_MODULES = ("main_dapo", "main_ppo", "verl.trainer", "fully_async_main")
_ASSIGN = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_ARRAY = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)=\((.*)$")
_ARRAY_USE = re.compile(r"\"?\$\{([A-Za-z_][A-Za-z0-9_]*)\[@\]\}\"?")
_DATE = re.compile(r"""\$\(date(?:\s+\+["']?([^"')]*)["']?)?\s*\)""")
_PLAIN = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")


def expand(text: str, env: dict[str, str], arrays: dict[str, list[str]] | None = None) -> str:
    """Shell expansion of the forms launch scripts use. A variable the script does not set becomes
    `${oc.env:NAME}`: the config reads it from the environment of the run, as the shell would."""
    if arrays:  # "${NAME[@]}": the array's words, each quoted again for the later split
        text = _ARRAY_USE.sub(lambda m: " ".join(shlex.quote(w) for w in arrays.get(m.group(1), [])), text)
    text = _DATE.sub(lambda m: time.strftime(m.group(1) or "%a %b %d %H:%M:%S %Z %Y"), text)  # run names
    text = _expand_braced(text, env)
    text = _PLAIN.sub(lambda m: env.get(m.group(1), _from_env(m.group(1))), text)
    return _expand_arithmetic(text, env)


def _from_env(name: str) -> str:
    return f"${{oc.env:{name}}}"


def _substitute(text: str, opener: str, close: str, replace: Callable[[str], str]) -> str:
    """Replace each `opener ... close` span, parentheses or braces nested inside, by
    `replace(inner text)`; an unclosed span stays as written (`${A:-"${B}/x"}`, `$(( (a+b)*2 ))`)."""
    out, i = [], 0
    while (start := text.find(opener, i)) >= 0:
        depth, j = opener.count(opener[-1]), start + len(opener)
        while j < len(text) and depth:
            depth += {opener[-1]: 1, close: -1}.get(text[j], 0)
            j += 1
        inner = text[start + len(opener):j - opener.count(opener[-1])]
        out += [text[i:start], text[start:j] if depth else replace(inner)]
        i = j
    return "".join(out) + text[i:]


def _expand_braced(text: str, env: dict[str, str]) -> str:
    def one(inner: str) -> str:
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?::?-(.*))?", inner, re.S)
        if not m:
            return "${" + inner + "}"  # not a variable we expand (`${oc.env:..}`, `${#x}`): as written
        if env.get(m.group(1)):
            return env[m.group(1)]
        if m.group(2) is not None:  # the default, itself expanded, its quotes removed
            default = _expand_braced(m.group(2), env)
            return " ".join(shlex.split(default)) if default.strip() else ""
        return _from_env(m.group(1))
    return _substitute(text, "${", "}", one)


def _expand_arithmetic(text: str, env: dict[str, str]) -> str:
    return _substitute(text, "$((", ")", lambda inner: _arithmetic(inner, env))


def _arithmetic(expr: str, env: dict[str, str]) -> str:
    expr = re.sub(r"[A-Za-z_][A-Za-z0-9_]*", lambda m: env.get(m.group(0), m.group(0)), expr)
    if not re.fullmatch(r"[\d\s+\-*/%()]+", expr):
        return f"$(({expr}))"  # not plain integer arithmetic: leave it for the reader
    return str(eval(expr.replace("/", "//")))  # digits, operators and parentheses only (checked above)


def _logical_lines(text: str) -> list[str]:
    lines = re.sub(r"\\\n", " ", text).splitlines()
    return [line.rstrip().rstrip("\\") for line in lines if line.strip() and not line.lstrip().startswith("#")]


def _words(text: str, env: dict[str, str], arrays: dict[str, list[str]]) -> list[str]:
    try:  # a quoted value, or several words: the shell's word rules
        return shlex.split(expand(text, env, arrays), comments=True)
    except ValueError as exc:
        raise ValueError(f"cannot split shell words ({exc}): {text.strip()[:80]}") from None


def _depth(lines: list[str]) -> int:
    text = "".join(lines)
    return text.count("(") - text.count(")")


def parse_script(text: str, env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """(the verl command's overrides, expanded; the script's variables). `env`: variables set
    before the script runs (`--env NAME=VALUE`)."""
    env = dict(env or {})
    arrays: dict[str, list[str]] = {}
    lines = iter(_logical_lines(text))
    for line in lines:
        if a := _ARRAY.match(line):  # NAME=( words... ) over lines, comments inside: ends where "(" balances
            body = [re.sub(r"(^|\s)#.*$", "", a.group(2))]
            while _depth(body) >= 0 and (nxt := next(lines, None)) is not None:
                body.append(re.sub(r"(^|\s)#.*$", "", nxt))
            joined = "\n".join(body).rstrip()
            arrays[a.group(1)] = _words(joined[:-1] if joined.endswith(")") else joined, env, arrays)
            continue
        if any(m in line for m in ENTRY_MODULES):
            tokens = _words(line, env, arrays)
            start = next(i for i, t in enumerate(tokens) if any(m in t for m in ENTRY_MODULES)) + 1
            overrides = [t for t in tokens[start:] if "=" in t and not t.startswith("-")]
            if overrides:
                return overrides, env
        m = _ASSIGN.match(line)
        if m:
            env[m.group(1)] = " ".join(_words(m.group(2).strip(), env, arrays))
    raise ValueError(f"no verl command ({' / '.join(ENTRY_MODULES)}) with key=value overrides found")


def report(outcomes) -> str:
    rows = [f"{o.action:<10} {o.key}={o.value}" + (f"  ->  {' '.join(o.ours)}" if o.ours and o.action != "ours" else "")
            + (f"  ({o.reason})" if o.reason else "") for o in outcomes]
    return "\n".join(rows)


def as_yaml(overrides: list[str], config_name: str) -> str:
    """The overrides as a config file that extends `config_name`."""
    from omegaconf import OmegaConf
    from dapo_megatron.config.load import scalar_lists
    tree = OmegaConf.from_dotlist([o.lstrip("+") for o in scalar_lists(overrides)])
    return f"defaults:\n  - {config_name}\n  - _self_\n\n" + OmegaConf.to_yaml(tree)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dapo_megatron.tools.from_verl", description=__doc__.split("\n\n")[0])
    p.add_argument("script", help="a verl launch script (bash)")
    p.add_argument("--config-name", default="dapo", help="our config the command starts from")
    p.add_argument("--yaml", action="store_true", help="print a YAML config instead of a command")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="a variable the script reads from its environment (others stay ${oc.env:NAME})")
    args = p.parse_args(argv)
    from dapo_megatron.config.verl_compat import ordered_overrides, resolve
    try:
        with open(args.script) as f:
            overrides, _ = parse_script(f.read(), dict(e.partition("=")[::2] for e in args.env))
    except (OSError, ValueError) as exc:
        print(f"error: {args.script}: {exc}", file=sys.stderr)
        return 2
    outcomes = resolve(overrides)
    ours = ordered_overrides(outcomes)
    print(f"# {len(outcomes)} keys of {os.path.basename(args.script)}:")
    print("\n".join("# " + line for line in report(outcomes).splitlines()))
    if args.yaml:
        print(as_yaml(ours, args.config_name))
    else:
        print(" \\\n  ".join(["python -m dapo_megatron.main --config-name " + args.config_name]
                             + [shlex.quote(o) for o in ours]))
    refused = [o for o in outcomes if o.action == "refused"]
    for o in refused:
        print(f"refused: {o.key}={o.value}: {o.reason}", file=sys.stderr)
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
