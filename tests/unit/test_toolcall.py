"""Tool calls (#20): the parser's table format, the registry and runner (every failure becomes
the tool's message), the code interpreter's sandbox on the cases a model's code can do harm
with, and a conversation's loss mask. No test needs a network or a GPU."""
import copy
import os
import textwrap
import time

import pytest
import torch

from dapo_megatron.assets.tokenizer import CHAT_TEMPLATE
from dapo_megatron.config.errors import ConfigError
from dapo_megatron.toolcall import (Conversation, Limits, ToolCall, ToolRunner, load_tools, parse_tool_calls,
                                    run_python, schema_of, tool_turn_ids)
from dapo_megatron.toolcall.sandbox import _SECCOMP_ARCH, landlock_abi

needs_landlock = pytest.mark.skipif(landlock_abi() == 0, reason="the kernel has no Landlock")


# ---- parsing -----------------------------------------------------------------------------------
def test_several_well_formed_calls_in_one_turn():
    text = ('Let me compute.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(123 * 456)"}}\n'
            '</tool_call>\nand <tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call> done')
    p = parse_tool_calls(text)
    assert p.calls == [ToolCall("python", {"code": "print(123 * 456)"}), ToolCall("add", {"a": 1, "b": 2})]
    assert not p.errors and not p.cut


@pytest.mark.parametrize("body,error", [
    ('{"name": "python", "arguments": {"code": "x"', "not valid JSON"),
    ('{"arguments": {}}', 'expected {"name"'),
    ('{"name": "python", "arguments": [1, 2]}', "must be an object"),
    ('{"name": "python", "arguments": "not json"}', "not JSON"),
])
def test_a_malformed_call_is_an_error_line_and_the_others_still_run(body, error):
    text = f'<tool_call>{body}</tool_call><tool_call>{{"name": "ok", "arguments": {{}}}}</tool_call>'
    p = parse_tool_calls(text)
    assert p.calls == [ToolCall("ok", {})] and len(p.errors) == 1 and p.errors[0].startswith("tool call 1: ")
    assert error in p.errors[0]


def test_a_call_cut_by_the_length_limit_is_reported_not_run():
    p = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call> then <tool_call>{"name": "py')
    assert p.calls == [ToolCall("a", {})] and p.cut and not p.errors
    assert parse_tool_calls("no calls here") == parse_tool_calls("")
    with pytest.raises(ValueError, match="hermes"):
        parse_tool_calls("x", fmt="mistral")


# ---- registry and runner -----------------------------------------------------------------------
def _user_tools(tmp_path):
    f = tmp_path / "my_tools.py"
    f.write_text(textwrap.dedent('''
        from __future__ import annotations
        import time

        def add(a: int, b: float = 0.5) -> str:
            """Add two numbers."""
            return str(a + b)

        def boom(x: str) -> str:
            raise RuntimeError("broken tool")

        def slow(seconds: float) -> str:
            time.sleep(seconds)
            return "done"
    '''))
    return [f"{f}:add", f"{f}:boom", f"{f}:slow", "python"]


def test_tools_load_by_entry_with_schemas(tmp_path):
    tools = load_tools(_user_tools(tmp_path))
    assert sorted(tools) == ["add", "boom", "python", "slow"]
    fn = tools["add"].schema["function"]
    assert fn["description"] == "Add two numbers." and fn["parameters"]["required"] == ["a"]
    assert fn["parameters"]["properties"] == {"a": {"type": "integer"}, "b": {"type": "number"}}
    assert schema_of("python", tools["python"].fn)["function"]["parameters"]["properties"] == {"code": {"type": "string"}}
    for bad, words in [(["nope"], "neither a built-in"), (["python", "python"], "twice"),
                       ([f"{tmp_path}/missing.py:f"], "not found")]:
        with pytest.raises(ConfigError) as err:
            load_tools(bad)
        assert err.value.key == "rollout.tools" and words in str(err.value)


def test_every_failure_is_the_tool_message_and_calls_run_concurrently(tmp_path):
    runner = ToolRunner(load_tools(_user_tools(tmp_path), Limits(wall_s=1.0)), pool=4, timeout_s=2.0)
    try:
        out = runner.run([ToolCall("add", {"a": 2}), ToolCall("nope", {}), ToolCall("add", {"c": 1}),
                          ToolCall("boom", {"x": "y"}), ToolCall("slow", {"seconds": 5}),
                          ToolCall("python", {"code": "print(123 * 456)"}),
                          ToolCall("python", {"code": "import time\ntime.sleep(30)"})])
        assert [(o.error, o.timeout) for o in out] == [(False, False), (True, False), (True, False), (True, False),
                                                        (True, True), (False, False), (True, True)]
        out = [o.message for o in out]
        assert out[0] == "2.5" and out[5] == "56088\n" and "[error: timeout after 1." in out[6]
        assert out[1].startswith("error: unknown tool 'nope'") and "python" in out[1]
        assert out[2].startswith("error: add: ") and "'a'" in out[2]
        assert out[3] == "error: boom raised RuntimeError: broken tool"
        assert out[4] == "error: slow did not finish in 2 s"
        start = time.monotonic()
        assert [o.message for o in runner.run([ToolCall("slow", {"seconds": 0.5})] * 4)] == ["done"] * 4
        assert time.monotonic() - start < 1.5  # 4 x 0.5 s on 4 threads
    finally:
        runner.close()


# ---- the sandbox -------------------------------------------------------------------------------
LIMITS = Limits(wall_s=4, cpu_s=4, memory_mb=512)


def test_the_interpreter_prints_imports_and_keeps_files_in_its_own_directory():
    r = run_python("import numpy as np\nopen('a.txt', 'w').write('hi')\nprint(np.arange(5).sum(), open('a.txt').read())",
                   LIMITS)
    assert r.ok and r.output == "10 hi\n" and r.message() == r.output


@pytest.mark.parametrize("code,error", [
    # An infinite loop: the wall-clock kill, or the CPU limit (the same 4 s) when it comes first;
    # on a loaded 2-core machine either can (seen in a --fast run: "killed by SIGXCPU").
    ("while True:\n    pass", ("timeout", "SIGXCPU")),
    ("import time\ntime.sleep(60)", "timeout"),
    ("x = bytearray(10 * 1024 ** 3)", "MemoryError"),  # 10 GB: over the address-space limit
    ("raise SystemExit(3)", "exit 3"),
])
def test_runaway_code_is_bounded_and_reported(code, error):
    start = time.monotonic()
    r = run_python(code, LIMITS)
    errors = error if isinstance(error, tuple) else (error,)
    assert not r.ok and any(e in r.message() for e in errors) and r.message().rstrip().endswith("]")
    assert time.monotonic() - start < LIMITS.wall_s + 3


@pytest.mark.skipif(os.uname().machine not in _SECCOMP_ARCH, reason="no seccomp syscall table for this machine")
def test_a_fork_bomb_fails_at_its_first_fork():
    r = run_python("import os\nwhile True:\n    os.fork()", LIMITS)
    assert not r.ok and "PermissionError" in r.output
    r = run_python("import subprocess\nprint(subprocess.run(['true']).returncode)", LIMITS)
    assert not r.ok and "PermissionError" in r.output
    r = run_python("import threading\nt = threading.Thread(target=print, args=('thread ran',))\nt.start(); t.join()",
                   LIMITS)
    assert r.ok and r.output == "thread ran\n"  # threads still start


def test_the_parent_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("DAPO_TEST_SECRET", "s3cret-token")
    r = run_python("import os\nprint(sorted(os.environ))", LIMITS)
    assert r.ok and "DAPO_TEST_SECRET" not in r.output and "s3cret" not in r.output


@needs_landlock
def test_the_parents_proc_environ_cannot_be_read(monkeypatch):
    monkeypatch.setenv("DAPO_TEST_SECRET", "s3cret-token")
    r = run_python("import os\nprint(open(f'/proc/{os.getppid()}/environ').read())", LIMITS)
    assert not r.ok and "PermissionError" in r.output and "s3cret" not in r.output


@needs_landlock
def test_writing_outside_its_directory_fails(tmp_path):
    for target in (tmp_path / "escaped.txt", "/tmp/dapo-escaped.txt"):
        r = run_python(f"open({str(target)!r}, 'w').write('x')", LIMITS)
        assert not r.ok and "PermissionError" in r.output, r.output
        assert not os.path.exists(target)


@needs_landlock
def test_no_network():
    import socket
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    try:
        r = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=2)",
                       LIMITS)
        assert not r.ok and "PermissionError" in r.output
    finally:
        server.close()


def test_long_output_is_truncated():
    r = run_python("print('y' * 100000)", LIMITS)
    assert r.ok and len(r.output) < LIMITS.output_chars + 100 and r.output.endswith("characters]")


# ---- conversations: the loss mask ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tools_tokenizer():
    from dapo_megatron.assets.tokenizer import TOOLS_CHAT_TEMPLATE, train_tokenizer
    from dapo_megatron.assets.tools import tool_corpus
    return train_tokenizer(corpus=tool_corpus(), chat_template=TOOLS_CHAT_TEMPLATE)


def test_tool_turn_is_the_templates_tool_message_and_next_header(tools_tokenizer):
    tok = tools_tokenizer
    ids = tool_turn_ids(tok, ["201954\n", "error: unknown tool 'x'"])
    assert tok.decode(ids) == ("\n<|im_start|>user\n<tool_response>\n201954\n\n</tool_response>\n<tool_response>\n"
                               "error: unknown tool 'x'\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    plain = copy.deepcopy(tok)  # plain ChatML renders role "tool" as a turn of its own
    plain.chat_template = CHAT_TEMPLATE
    assert tok.decode(tool_turn_ids(plain, ["7"])) == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    plain.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('roles must "
                           "alternate user/assistant') }}{% endif %}{{ m['content'] + eos_token }}{% endfor %}")
    with pytest.raises(ValueError, match="cannot render tool messages .*alternate.*'tool' role"):
        tool_turn_ids(plain, ["x"])


def test_hand_built_conversation_masks_exactly_the_tool_tokens(tools_tokenizer):
    """Model turn, tool message, model turn: the mask is 1 on the two turns (their eos too) and 0
    on every token from after the first eos to the assistant header, checked token by token
    against the text; tool tokens carry rollout log-prob 0; the batch and the loss follow it."""
    tok, eos = tools_tokenizer, tools_tokenizer.eos_token_id
    call = tok.encode('<tool_call>\n{"name": "python", "arguments": {"code": "print(347*582)"}}\n</tool_call>') + [eos]
    answer = tok.encode("\\boxed{201954}") + [eos]
    conv = Conversation()
    conv.add_model(call, [-0.5] * len(call))
    assert parse_tool_calls(tok.decode(conv.turn_tokens())).calls == [ToolCall("python", {"code": "print(347*582)"})]
    assert conv.add_tool(tool_turn_ids(tok, [run_python("print(347*582)").message()]), budget=200)
    assert conv.turns == 2 and conv.turn_tokens() == []
    conv.add_model(answer, [-0.25] * len(answer))
    pieces = [tok.decode([t]) for t in conv.tokens]
    text = "".join(pieces)
    tool_text = "\n<|im_start|>user\n<tool_response>\n201954\n\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    start = text.index("</tool_call><|im_end|>") + len("</tool_call><|im_end|>")
    assert text[start:start + len(tool_text)] == tool_text
    expected, pos = [], 0
    for piece in pieces:  # a token is a tool token when its text lies inside the tool span
        expected.append(0 if start <= pos < start + len(tool_text) else 1)
        pos += len(piece)
    assert conv.mask == expected and sum(conv.mask) == len(call) + len(answer)
    assert [lp for lp, m in zip(conv.logprobs, conv.mask) if not m] == [0.0] * (len(conv.tokens) - sum(conv.mask))

    from dapo_megatron.algo.loss import compute_policy_loss
    from dapo_megatron.batch import RolloutBatch
    batch = RolloutBatch.from_samples([dict(prompts=[1, 2, 3], responses=conv.tokens, loss_mask=conv.mask,
                                            rollout_logprobs=conv.logprobs)])
    assert batch.loss_mask[0].tolist() == [float(m) for m in conv.mask]
    old = torch.tensor([conv.logprobs])
    new = old.clone().requires_grad_(True)
    adv = torch.ones_like(old)
    loss, _ = compute_policy_loss(old, new, adv, batch.loss_mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                  loss_agg_mode="token-mean")
    loss.backward()
    assert (new.grad[0][batch.loss_mask[0] == 0] == 0).all() and (new.grad[0][batch.loss_mask[0] == 1] != 0).all()


def test_tool_tokens_are_cut_at_the_response_budget():
    conv = Conversation()
    conv.add_model([5, 6, 7], [-1.0] * 3)
    assert not conv.add_tool([1, 2, 3, 4], budget=5)  # 3 + 2 of 4 tool tokens: no room for a turn
    assert conv.tokens == [5, 6, 7, 1, 2] and conv.mask == [1, 1, 1, 0, 0]
