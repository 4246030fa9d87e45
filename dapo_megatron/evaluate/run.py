"""`python -m dapo_megatron.evaluate` once its arguments parse: load the config, the model (a
checkpoint exported first) and the data, generate on local vLLM engines, score with the reward
table, summarize per data_source, write the generations and the table.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import ray
from tqdm import tqdm
from transformers import AutoTokenizer

from dapo_megatron import roles
from dapo_megatron.assets import resolve_asset_path
from dapo_megatron.config import ConfigError, check_lengths_fit, load_config, load_run_config
from dapo_megatron.convert.run import mcore_to_hf
from dapo_megatron.convert.usage import UsageError, build_parser
from dapo_megatron.data.dataset import DataError, PromptDataset
from dapo_megatron.device import get_device
from dapo_megatron.driver.setup import image_token_counter, stop_token_ids, tool_schemas
from dapo_megatron.models import ModelSpec
from dapo_megatron.reward.manager import RewardManager
from dapo_megatron.reward.metrics import group_metrics, maj_method, mean_by_source
from dapo_megatron.rollout.actor import engine_actor
from dapo_megatron.rollout.engine_spec import EngineSpec
from dapo_megatron.rollout.types import Sampling
from dapo_megatron.train.parallel import WorkerError
from dapo_megatron.weights.hf_io import CheckpointError
from dapo_megatron.weights.load import check_hf_checkpoint

EXIT_BAD_INPUT = 2


def evaluate(args) -> int:
    """Run the parsed command line; the exit code (2 with one `error:` line on bad input)."""
    try:
        cfg, model, out, tokenizer, data, files = load(args)
    except (ConfigError, DataError, CheckpointError, UsageError, WorkerError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    t0 = time.perf_counter()
    try:
        groups = generate(cfg, model, out, tokenizer, data, args.engines, args.batch)
    except roles.StartFailed as exc:  # vLLM refused its arguments, or a file of the model
        print(f"error: {exc}; library output: {os.path.join(out, 'engine-*.log')}", file=sys.stderr)
        return EXIT_BAD_INPUT
    records = score(cfg, tokenizer, data.items, groups)
    summary = summarize(records, cfg.rollout.val_kwargs.n)
    summary.update(model=args.model, data=files, seconds=time.perf_counter() - t0)
    with open(os.path.join(out, "generations.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(render(summary))
    print(f"wrote {os.path.join(out, 'generations.jsonl')} and summary.json")
    return 0


def _checkpoint_run_config(path: str) -> str | None:
    """`<run>/config.yaml` of a checkpoint folder `<run>/checkpoints/step_N`, if it is one."""
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        return None
    run_config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))), "config.yaml")
    return run_config if os.path.isfile(run_config) else None


def resolve_model(path: str, out: str) -> str:
    """An HF folder to load: tiny:// built, a checkpoint exported into `out`/model."""
    path = resolve_asset_path(path)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    if os.path.isfile(os.path.join(path, "metadata.json")):
        target = os.path.join(out, "model")
        args = build_parser().parse_args(["mcore-to-hf", "--ckpt", path, "--out", target, "--force", "--device", "cpu"])
        return mcore_to_hf(args)
    raise ConfigError("--model", f"--model {path}: not an HF folder (config.json), a tiny:// name or a training "
                                 "checkpoint (a step_N folder with metadata.json)")


def load(args):
    """(config, HF model dir, out dir, dataset): everything checked before an engine starts."""
    run_config = _checkpoint_run_config(args.model)
    cfg = load_run_config(run_config, args.overrides) if run_config else load_config(args.config_name, args.overrides)
    name = os.path.basename(os.path.normpath(args.model.replace("tiny://", "")))
    out = args.out or os.path.join("eval", name)
    os.makedirs(out, exist_ok=True)
    model = resolve_model(args.model, out)
    spec = ModelSpec.from_pretrained(model)
    check_hf_checkpoint(model, spec)  # its files, read as the engine will, before an engine starts
    fitted = fit_lengths(cfg, spec, args.overrides, from_run=run_config is not None)
    if fitted:
        print(fitted, file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(model)
    files = [resolve_asset_path(f) for f in (args.data if args.data is not None else cfg.data.val_files)]
    if not files:
        raise ConfigError("--data", "no data: pass --data FILE (or set data.val_files)")
    data = PromptDataset(files, tokenizer, prompt_key=cfg.data.prompt_key, max_prompt_length=cfg.data.max_prompt_length,
                         truncation=cfg.data.truncation, skip_bad_rows=cfg.data.skip_bad_rows, config_key="--data",
                         tools=tool_schemas(cfg, tokenizer, "--model"),
                         image_tokens=image_token_counter(spec, model, "--model"))
    v = cfg.rollout.val_kwargs
    for key, value in (("n", args.n), ("temperature", args.temperature), ("top_p", args.top_p)):
        if value is not None:
            setattr(v, key, value)
    if v.n < 1:
        raise ConfigError("--n", f"--n must be >= 1, got {v.n}")
    if v.n > 1 and v.temperature == 0:
        print(f"note: greedy decoding (rollout.val_kwargs.temperature=0): the {v.n} samples of a prompt are one "
              f"sample {v.n} times, so avg@k = pass@k = maj@k; pass --temperature 1.0 to sample", file=sys.stderr)
    return cfg, model, out, tokenizer, data, files


LENGTH_KEYS = ("data.max_prompt_length", "data.max_response_length")


def fit_lengths(cfg, spec: ModelSpec, overrides: list[str], from_run: bool) -> str | None:
    """Prompt + response within the model's max_position_embeddings. Lengths someone chose (the
    user's overrides, the checkpoint's run) are checked by training's rule, one line naming the
    keys; a config's defaults (dapo.yaml: 2048 + 20480) shrink to fit, the prompt to at most half.
    Returns the line that says what was fitted, if any."""
    d, max_pos = cfg.data, spec.max_position_embeddings
    if from_run or any(o.lstrip("+").split("=", 1)[0] in LENGTH_KEYS for o in overrides):
        check_lengths_fit(cfg, spec)
        return None
    if max_pos is None or d.max_prompt_length + d.max_response_length <= max_pos:
        return None
    before = d.max_response_length
    d.max_prompt_length = min(d.max_prompt_length, max_pos // 2)
    d.max_response_length = max_pos - d.max_prompt_length
    buffer, shaped = cfg.reward.overlong_buffer, ""
    if buffer.enable and buffer.len > d.max_response_length:  # its share of the response kept (validation's rule)
        buffer.len = max(1, buffer.len * d.max_response_length // before)
        shaped = f" (reward.overlong_buffer.len={buffer.len}, the same share of it)"
    return (f"lengths: data.max_prompt_length={d.max_prompt_length} + data.max_response_length="
            f"{d.max_response_length}{shaped}, fitted to the model's max_position_embeddings ({max_pos}); set them "
            f"to choose")


def generate(cfg, model: str, out: str, tokenizer, data, engines: int, batch: int) -> list:
    """Every prompt's group of n samples, in dataset order, from `engines` local engines."""
    device = get_device(cfg.trainer.device)
    # Its own Ray, even beside a cluster `ray start` left here (which ray.init would otherwise
    # join, refusing num_cpus): the engines are this command's, on this machine.
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, engines), include_dashboard=False,
             log_to_driver=False)
    spec = EngineSpec.from_model(model, cfg.rollout, dtype=cfg.model.dtype, tokenizer_path=model,
                                 max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
                                 engines=engines)
    handles = [engine_actor(spec, device=device.kind, log_path=os.path.join(out, f"engine-{j}.log"),
                            **device.ray_options(1.0)) for j in range(engines)]
    # The training loop's validation sampling: val_kwargs, its seed, the chat template's stops.
    sampling = Sampling.validation(cfg.rollout, cfg.data.max_response_length, seed=cfg.rollout.seed)
    sampling = Sampling(**{**vars(sampling), "stop_token_ids": stop_token_ids(tokenizer)})
    items, groups = list(data.items), []
    try:
        with tqdm(total=len(items), desc="prompts", unit="prompt", file=sys.stderr) as bar:
            for start in range(0, len(items), batch * engines):
                block = items[start:start + batch * engines]
                shards = [block[j::engines] for j in range(engines)]
                results = roles.get("rollout engine", [h.generate.remote([it.prompt for it in s], sampling)
                                                       for h, s in zip(handles, shards) if s])
                ordered = [None] * len(block)
                for j, res in enumerate(results):
                    for i, g in enumerate(res):
                        ordered[j + i * engines] = g
                groups += ordered
                bar.update(len(block))
    finally:
        with contextlib.suppress(ray.exceptions.RayActorError):  # one that did not start
            ray.get([h.shutdown.remote() for h in handles])
        ray.shutdown()
    return groups


def score(cfg, tokenizer, items, groups) -> list[dict]:
    """One record per sample: prompt index, data_source, text, answer, correct, length, cut."""
    rows = [(it, g, i) for it, g in zip(items, groups) for i in range(len(g.responses))]
    texts = tokenizer.batch_decode([g.responses[i] for _, g, i in rows], skip_special_tokens=True)
    with RewardManager(cfg.reward, cfg.data.max_response_length) as reward:
        out = reward(texts, [it.ground_truth for it, _, _ in rows], [len(g.responses[i]) for _, g, i in rows],
                     data_sources=[it.data_source for it, _, _ in rows],
                     extra_infos=[it.extra_info for it, _, _ in rows])
    return [{"index": it.index, "sample": i, "data_source": it.data_source, "response": text, "answer": pred,
             "correct": bool(acc), "score": float(s), "length": len(g.responses[i]),
             "cut": g.finish_reasons[i] == "length"}
            for (it, g, i), text, pred, acc, s in zip(rows, texts, out.pred, out.acc.tolist(), out.score.tolist())]


def summarize(records: list[dict], n: int) -> dict:
    """{data_source (and "all"): {avg@n, pass@k, maj@k..., response_length, cut}} averaged over prompts."""
    by_prompt: dict[int, list[dict]] = {}
    for r in records:
        by_prompt.setdefault(r["index"], []).append(r)
    rows = []
    for samples in by_prompt.values():
        metrics = group_metrics([s["answer"] for s in samples], [s["correct"] for s in samples])
        metrics["response_length"] = sum(s["length"] for s in samples) / len(samples)
        metrics["cut"] = sum(s["cut"] for s in samples) / len(samples)
        rows.append((samples[0]["data_source"], metrics))
    out = mean_by_source(rows)
    for src in out:
        out[src]["prompts"] = sum(1 for s, _ in rows if src in (s, "all"))
    return {"n": n, "maj_method": maj_method(n), "sources": out}


def render(summary: dict) -> str:
    sources = summary["sources"]
    cols = [c for c in next(iter(sources.values())) if c != "prompts"]
    lines = [f"{'data_source':<24}{'prompts':>8}" + "".join(f"{c:>16}" for c in cols)]
    for src in sorted(sources, key=lambda s: (s == "all", s)):
        row = sources[src]
        lines.append(f"{src:<24}{row['prompts']:>8}" + "".join(f"{row[c]:>16.4f}" for c in cols))
    lines.append(f"maj@k: {summary['maj_method']} expectation over subsets of k (reward/metrics.py)")
    return "\n".join(lines)
