"""The documented commands that run on the tiny assets, each with the end-to-end test that runs it.

A command in README.md or docs/ that starts a run on a tiny config (`bash launch/demo.sh`,
`python -m dapo_megatron.main --config-name quickstart...`) must be a key here; the test named
beside it builds its command line with `doc_args(key)` (the documented arguments) and adds only
its sizing overrides (paths, steps, batch): tests/unit/test_docs.py checks both ends, so a
documented command is either run by a test or the docs test fails naming it.
"""
from __future__ import annotations

import shlex

# documented command -> (its arguments to `python -m dapo_megatron.main`, the test file that runs it)
DOC_RUNS: dict[str, tuple[list[str], str]] = {
    "bash launch/demo.sh": (["--config-name", "quickstart"], "tests/e2e/test_driver.py"),
    "python -m dapo_megatron.main --config-name quickstart": (["--config-name", "quickstart"], "tests/e2e/test_driver.py"),
    "python -m dapo_megatron.main --config-name quickstart_async":
        (["--config-name", "quickstart_async"], "tests/e2e/test_async.py"),
    "python -m dapo_megatron.main --config-name quickstart_tools":
        (["--config-name", "quickstart_tools"], "tests/e2e/test_tools_quickstart.py"),
    "python -m dapo_megatron.main --config-name quickstart_vl":
        (["--config-name", "quickstart_vl"], "tests/e2e/test_vl_quickstart.py"),
}


def doc_args(command: str) -> list[str]:
    """The arguments to `python -m dapo_megatron.main` of a documented command."""
    return list(DOC_RUNS[command][0])


def normalize(command: str) -> str:
    """One spelling per command: `.venv/bin/python` is `python`, whitespace collapsed."""
    words = shlex.split(command)
    if words and words[0].endswith("/python"):
        words[0] = "python"
    return " ".join(words)
