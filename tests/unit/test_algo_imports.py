"""dapo_megatron.algo stays pure torch: testable and reusable without Megatron, vLLM or Ray."""
import ast
import pathlib
import sys

import dapo_megatron.algo

ALGO_DIR = pathlib.Path(dapo_megatron.algo.__file__).parent


def test_algo_imports_only_torch_and_stdlib():
    allowed = set(sys.stdlib_module_names) | {"torch", "dapo_megatron"}
    for path in ALGO_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"
                assert not name.startswith("dapo_megatron.") or name.startswith("dapo_megatron.algo"), name
