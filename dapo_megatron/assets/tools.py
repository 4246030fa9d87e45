"""The tool task's tiny assets (`tiny://tools/...`): a tokenizer whose chat template renders tool
messages, a tiny Qwen2 warmed up on two-turn conversations (a `python` call, then the boxed
answer from the tool's message), and the multiplication data (data/tool_task.py).

Built into <asset dir>/tools on first use, apart from the addition bundle, so the main demo
never pays for it. The warm-up is the same supervised loop as the addition task's, on whole
conversations with the loss on model turns only, and stops at a sampled accuracy that leaves
RL headroom; the accuracy is measured by real multi-turn sampling with the real interpreter.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from dapo_megatron.assets.models import build_tiny_model
from dapo_megatron.assets.tokenizer import (DEFAULT_SYSTEM_PROMPT, TOOLS_CHAT_TEMPLATE, build_tokenizer,
                                            special_token_ids)
from dapo_megatron.assets.warmup import BOXED, IGNORE_INDEX, sample_responses, supervised_warmup
from dapo_megatron.data import tool_task
from dapo_megatron.toolcall.conversation import tool_turn_ids
from dapo_megatron.toolcall.parse import parse_tool_calls
from dapo_megatron.toolcall.registry import ToolRunner, load_tools

TOOLS_VERSION = "tools-v2"
MODEL_KIND = "qwen2"
TARGET_ACCURACY = 0.3  # seed 0: reached after 150 steps (64 s), 0.34 train / 0.37 val sampled accuracy
WARMUP_STEPS = 1000
WARMUP = dict(batch_size=32, lr=1e-3)
CALL_TOKENS, ANSWER_TOKENS = 48, 16  # sampling limits of the two turns in the accuracy check


def tool_corpus() -> list[str]:
    """Tokenizer training lines: the two-turn conversations in their chat scaffolding."""
    lines = ["system\n" + DEFAULT_SYSTEM_PROMPT, "system\n" + tool_task.SYSTEM_PROMPT, "user\n", "assistant\n",
             "tool\n"]
    for a, b in tool_task.pairs(seed=12345, count=300):  # any pairs: only the merges are learnt
        lines += [f"user\n{a}*{b}=", "assistant\n" + tool_task.call_text(a, b),
                  f"user\n<tool_response>\n{a * b}\n\n</tool_response>", "assistant\n" + tool_task.answer_text(a, b)]
    return lines


def conversation_ids(tokenizer, a: int, b: int,
                     tool_message: str | None = None) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, response ids, response loss mask) of the reference two-turn conversation."""
    prompt = tokenizer.encode(tokenizer.apply_chat_template(tool_task.prompt_messages(a, b), tokenize=False,
                                                            add_generation_prompt=True), add_special_tokens=False)
    eos = tokenizer.eos_token_id
    call = tokenizer.encode(tool_task.call_text(a, b), add_special_tokens=False) + [eos]
    tool = tool_turn_ids(tokenizer, [tool_message if tool_message is not None else f"{a * b}\n"])
    answer = tokenizer.encode(tool_task.answer_text(a, b), add_special_tokens=False) + [eos]
    return prompt, call + tool + answer, [1] * len(call) + [0] * len(tool) + [1] * len(answer)


def supervised_batch(tokenizer, pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of whole conversations, labels on the model's turns only. # [N, T]"""
    rows = [conversation_ids(tokenizer, a, b) for a, b in pairs]
    width = max(len(p) + len(r) for p, r, _ in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    for i, (prompt, response, mask) in enumerate(rows):
        ids = torch.tensor(prompt + response)
        input_ids[i, :len(ids)] = ids
        keep = torch.tensor([0] * len(prompt) + mask, dtype=torch.bool)
        labels[i, :len(ids)] = torch.where(keep, ids, torch.full_like(ids, IGNORE_INDEX))
    return input_ids, labels


def tool_accuracy(model, tokenizer, pairs, *, samples_per_pair: int = 4, temperature: float = 1.0,
                  seed: int = 0, runner: ToolRunner | None = None) -> dict[str, float]:
    """Sample whole conversations (call turn, the real interpreter's message, answer turn) and
    score the last \\boxed{} like the reward does. Returns accuracy and the share of calls that ran."""
    own = runner is None
    runner = runner or ToolRunner(load_tools(["python"]), pool=4)
    gen = torch.Generator().manual_seed(seed)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompts = torch.tensor([conversation_ids(tokenizer, a, b)[0] for a, b in pairs])
    first = sample_responses(model, prompts, samples_per_prompt=samples_per_pair, eos_token_id=eos,
                             pad_token_id=pad, max_new_tokens=CALL_TOKENS, temperature=temperature, generator=gen)
    outputs: dict[str, str] = {}  # code -> interpreter output (many samples write the same code)
    follow: dict[int, list[tuple[int, list[int]]]] = {}  # continuation length -> [(sample, ids)]
    ran = 0
    for s, row in enumerate(first.tolist()):
        turn = row[:row.index(eos) + 1] if eos in row else None
        calls = parse_tool_calls(tokenizer.decode(turn)).calls if turn else []
        if not calls or calls[0].name != "python" or "code" not in calls[0].arguments:
            continue
        code = str(calls[0].arguments["code"])
        if code not in outputs:
            outputs[code] = runner.run([calls[0]])[0].message
        ran += 1
        ids = prompts[s // samples_per_pair].tolist() + turn + tool_turn_ids(tokenizer, [outputs[code]])
        follow.setdefault(len(ids), []).append((s, ids))
    correct = 0
    for rows in follow.values():
        answers = sample_responses(model, torch.tensor([ids for _, ids in rows]), samples_per_prompt=1,
                                   eos_token_id=eos, pad_token_id=pad, max_new_tokens=ANSWER_TOKENS,
                                   temperature=temperature, generator=gen)
        for (s, _), text in zip(rows, tokenizer.batch_decode(answers, skip_special_tokens=True)):
            a, b = pairs[s // samples_per_pair]
            found = BOXED.findall(text)
            correct += bool(found) and found[-1].strip() == str(a * b)
    if own:
        runner.close()
    return {"accuracy": correct / len(first), "calls_ran": ran / len(first)}


def finish_model_dir(model_dir: Path, tokenizer_dir: Path, ids: dict[str, int]) -> None:
    """Generation config and tokenizer files beside the weights: each model dir is self-contained.
    Both bundles' models take it (assets/build.py imports it from here: one way, no circle)."""
    from transformers import GenerationConfig
    # Qwen2.5-Instruct stops on either end token; vLLM reads this list from generation_config.
    GenerationConfig(bos_token_id=ids["bos_token_id"], pad_token_id=ids["pad_token_id"],
                     eos_token_id=[ids["eos_token_id"], ids["pad_token_id"]]).save_pretrained(str(model_dir))
    for f in sorted(tokenizer_dir.iterdir()):
        shutil.copy2(f, model_dir / f.name)


def build_tool_bundle(root: Path, *, seed: int, warmup_steps: int, log: Callable[[str], None],
                      accuracy: bool = True) -> dict[str, Any]:
    """Tokenizer, data and warmed-up model into `root`; returns the manifest (also written).
    `accuracy`: measure the warmed model's train / val accuracy for the manifest (a third of the
    build; the test session's bundle skips it, the weights are the same)."""
    from transformers import AutoModelForCausalLM
    start = time.perf_counter()
    tokenizer = build_tokenizer(str(root / "tokenizer"), corpus=tool_corpus(), chat_template=TOOLS_CHAT_TEMPLATE)
    train_rows, val_rows = tool_task.make_splits(seed)
    (root / "data").mkdir()
    for name, rows in (("train", train_rows), ("val", val_rows)):
        pq.write_table(pa.Table.from_pylist(rows), root / "data" / f"{name}.parquet")
    ids = special_token_ids(tokenizer)
    model_dir = root / MODEL_KIND
    build_tiny_model(MODEL_KIND, str(model_dir), vocab_size=len(tokenizer), seed=seed, special_token_ids=ids)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    train_pairs, val_pairs = tool_task.split_pairs(seed)
    stats: dict[str, Any] = {"params": sum(p.numel() for p in model.parameters())}
    runner = ToolRunner(load_tools(["python"]), pool=4)
    check = train_pairs[:32]

    def reached() -> bool:
        return tool_accuracy(model, tokenizer, check, seed=seed, runner=runner)["accuracy"] >= TARGET_ACCURACY

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # same bytes on any machine (see assets/build.py)
    try:
        begin = time.perf_counter()
        input_ids, labels = supervised_batch(tokenizer, train_pairs)
        losses = supervised_warmup(model, tokenizer, train_pairs, steps=warmup_steps, seed=seed, stop=reached,
                                   check_every=25, batch=(input_ids, labels), **WARMUP) if warmup_steps else []
        stats.update({"warmup_steps_taken": len(losses), "warmup_seconds": round(time.perf_counter() - begin, 2)})
        if losses:
            stats.update({"loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4)})
        if accuracy:
            stats["train"] = tool_accuracy(model, tokenizer, train_pairs[:64], seed=seed, runner=runner)
            stats["val"] = tool_accuracy(model, tokenizer, val_pairs, seed=seed, runner=runner)
    finally:
        torch.set_num_threads(before)
        runner.close()
    model.save_pretrained(str(model_dir), safe_serialization=True)
    finish_model_dir(model_dir, root / "tokenizer", ids)
    log(f"tools/{MODEL_KIND}: {stats}")
    manifest = {"asset_version": TOOLS_VERSION, "seed": seed, "warmup_steps": warmup_steps,
                "target_accuracy": TARGET_ACCURACY, "warmup": WARMUP, "models": {MODEL_KIND: stats},
                "data": {"data_source": tool_task.DATA_SOURCE, "train_rows": len(train_rows),
                         "val_rows": len(val_rows)},
                "build_seconds": round(time.perf_counter() - start, 2)}
    return manifest  # written by build._atomic_build, with the kernels and the checksum
