"""TRL's side of bench/vs_trl.py; runs inside the TRL venv that vs_trl.py makes, never in ours.

    python bench/_trl_side.py SETTINGS.json OUT_DIR

`GRPOTrainer(loss_type="dapo")` with HF generate on our tiny model, prompts and reward, with the
settings vs_trl.py derived from our quickstart config. Writes OUT_DIR/steps.jsonl: one line per
optimizer step with its seconds (step, gen_and_score, score), mean reward and mean completion length.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import time

import pyarrow.parquet as pq
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

# Our reward is pure python + math-verify: import the very function our pool calls, not a copy.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dapo_megatron.reward.math_score import score  # noqa: E402


def math_reward(completions: list[str], ground_truth: list[str], **_) -> list[float]:
    return [score(c, g).score for c, g in zip(completions, ground_truth)]


def prompts(train_file: str, tokenizer) -> Dataset:
    """The parquet's chat messages rendered as our dataset does (data/dataset.py): the template's
    text with the generation header; TRL then tokenizes it as plain text (the template wrote any
    special token, and this tokenizer adds none)."""
    rows = pq.read_table(train_file, columns=["prompt", "reward_model"]).to_pylist()
    return Dataset.from_list([{
        "prompt": tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
        "ground_truth": r["reward_model"]["ground_truth"]} for r in rows])


def timed(clock: dict, name: str, fn):
    """`fn`, adding its seconds to clock[name]: how the step's anatomy is read without a fork of TRL."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock[name] = clock.get(name, 0.0) + time.perf_counter() - t0
    return wrapper


class StepLog(TrainerCallback):
    """Step seconds from on_step_begin to on_step_end (generation, scoring, loss and optimizer;
    not the logging after it), the clock's phases, and the `reward` TRL logs for the step."""

    def __init__(self, clock: dict):
        self.clock, self.rows, self._t0 = clock, {}, 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.clock.clear()
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.rows[state.global_step] = {"step": state.global_step, "step_s": time.perf_counter() - self._t0,
                                        **self.clock}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs and state.global_step in self.rows:
            self.rows[state.global_step]["reward"] = logs["reward"]
            self.rows[state.global_step]["length"] = logs["completions/mean_length"]


def main() -> None:
    settings_path, out = sys.argv[1:3]
    s = json.load(open(settings_path))
    tokenizer = AutoTokenizer.from_pretrained(s["model"])
    model = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
    config = GRPOConfig(output_dir=out, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                        logging_steps=1, disable_tqdm=True, gradient_accumulation_steps=1,
                        lr_scheduler_type="constant", warmup_steps=0, **s["grpo"])
    clock: dict[str, float] = {}
    log = StepLog(clock)
    trainer = GRPOTrainer(model=model, reward_funcs=math_reward, args=config, processing_class=tokenizer,
                          train_dataset=prompts(s["train_file"], tokenizer), callbacks=[log])
    # Instance attributes shadow the methods TRL calls on self: no subclass, no copied code.
    trainer._generate_and_score_completions = timed(clock, "gen_and_score", trainer._generate_and_score_completions)
    trainer._calculate_rewards = timed(clock, "score", trainer._calculate_rewards)
    print(f"TRL side: torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    trainer.train()
    with open(os.path.join(out, "steps.jsonl"), "w") as f:
        f.writelines(json.dumps(row) + "\n" for _, row in sorted(log.rows.items()))


if __name__ == "__main__":
    main()
