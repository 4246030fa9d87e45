"""The VL quickstart end to end (tiny Qwen3-VL-MoE, geo3k-format figures, EP2 actor, one
vLLM-CPU engine): two steps with dynamic sampling in sync mode and a checkpoint each, then a
resumed run, in the same process and Ray, that takes a third step in early-stop mode. The
random-init model is scored by a checksum reward (tests/e2e/parity_reward.py) so that groups
are mixed."""
from __future__ import annotations

import json
import os

import pytest

from tests import cli
from tests.doc_runs import doc_args

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HERE = os.path.dirname(__file__)


def _overrides(model, data, out, steps: int, mode: str) -> list[str]:
    overrides = {
        "model.path": str(model), "data.train_files": f"[{data / 'train.parquet'}]",
        "data.val_files": f"[{data / 'test.parquet'}]",
        "data.train_batch_size": 4, "data.gen_batch_size": 6, "rollout.n": 4, "actor.ppo_mini_batch_size": 2,
        "data.max_response_length": 12, "algorithm.filter_groups.mode": mode,
        "trainer.total_training_steps": steps, "trainer.save_freq": 1, "trainer.test_freq": 2,
        "trainer.val_before_train": "false", "trainer.default_local_dir": str(out),
        "trainer.logger": "[console,jsonl]", "reward.custom_fn": f"{HERE}/parity_reward.py:compute_score"}
    return [f"{k}={v}" for k, v in overrides.items()]


@pytest.fixture(scope="module")
def vl_run(tiny_vl_model, geo3k_data, tmp_path_factory, local_ray):
    """Both runs in this process on the session's Ray (tests/conftest.py), as a notebook's second
    run does: the first run's end gave back its placement group, actors and data plane."""
    from dapo_megatron.main import main
    out = tmp_path_factory.mktemp("vl") / "run"
    for steps, mode in ((2, "sync"), (3, "early_stop")):
        assert main([*doc_args("python -m dapo_megatron.main --config-name quickstart_vl"),
                     *_overrides(tiny_vl_model, geo3k_data, out, steps, mode)]) == 0
        assert local_ray.is_initialized()
    return out


def test_vl_quickstart_sync_then_resume_early_stop(vl_run):
    out = vl_run
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in rows if "actor/grad_norm" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]  # the third step resumed from step 2's checkpoint
    assert "sampling/aborted_groups" in steps[2] and "sampling/aborted_groups" not in steps[0]
    for r in steps:
        # The actor scored the engine's tokens with the engine's pixels: fp32 on both sides.
        assert r["rollout/logprob_diff_max"] < 1e-3
        # Pixels travel through the data plane: the driver gets keys and lengths (~100 B per
        # response), each rank reads image rows (a 224 px figure is 784 patches x 384 floats).
        assert r["driver/bytes_per_response"] < 256
        assert r["data_plane/bytes_get"] > 784 * 384 * 4
        assert r["data_plane/resident_mb"] == 0
    # validated at step 2 only (trainer.test_freq=2): its value is the journey's check below
    assert [r["step"] for r in rows if "val/acc" in r] == [2]
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_2", "step_3"]


def test_vl_journey_evaluate_the_checkpoint_and_serve_its_export(vl_run, geo3k_data, tmp_path):
    """train -> evaluate the checkpoint -> its export: `python -m dapo_megatron.evaluate --model
    <run>/checkpoints/step_2` (the run's config: its validation files, lengths, greedy val_kwargs,
    checksum reward) exports the VL checkpoint with its processor files, and our engine on that
    export scores the val/acc the run logged at step 2; the export read by evaluate with no config
    flag (dapo.yaml's lengths fitted, each prompt's image counted by the export's own processor);
    then vLLM's own `LLM` loads the export and its greedy tokens are our engine's."""
    import time
    from argparse import Namespace

    from dapo_megatron.driver.setup import image_token_counter
    from dapo_megatron.evaluate.run import load
    from dapo_megatron.models import ModelSpec
    val = [json.loads(line) for line in open(vl_run / "metrics.jsonl") if "val/acc" in line][0]
    out, test = tmp_path / "eval", str(geo3k_data / "test.parquet")
    evaluating = cli.start("-m", "dapo_megatron.evaluate", "--model", vl_run / "checkpoints" / "step_2", "--out", out)
    # vLLM's own LLM on the export as soon as evaluate has written it (a folder renamed into place),
    # beside evaluate's engine
    export, served, deadline = out / "model", tmp_path / "served.jsonl", time.monotonic() + 300
    while not export.exists() and evaluating.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    serving = cli.start(os.path.join(HERE, "vllm_greedy.py"), export, test, 12, served)
    cli.finish(evaluating)
    overall = json.loads((out / "summary.json").read_text())["sources"]["all"]
    assert val["step"] == 2 and overall["avg@1"] == pytest.approx(val["val/acc"], abs=1e-9)
    assert {"preprocessor_config.json", "chat_template.jinja", "config.json"} <= set(os.listdir(export))

    cfg, model, _, _, data, _ = load(Namespace(model=str(export), data=[test], config_name="dapo", n=None,
                                               temperature=None, top_p=None, out=str(tmp_path / "eval-export"),
                                               overrides=[]))
    fitted = ModelSpec.from_pretrained(str(export)).max_position_embeddings  # dapo.yaml's 2048 + 20480 exceed it
    assert model == str(export) and cfg.data.max_prompt_length + cfg.data.max_response_length == fitted
    assert len(data.items) == overall["prompts"] and all(it.prompt.images for it in data.items)

    counts = image_token_counter(ModelSpec.from_pretrained(str(export)), str(export), "--model")
    image_pad = json.loads((export / "config.json").read_text())["image_token_id"]

    def expanded(ids, images) -> list[int]:  # our prompt, its image pad expanded as the engine does
        (n,) = counts(images)
        i = ids.index(image_pad)
        return [*ids[:i], *[image_pad] * n, *ids[i + 1:]]

    cli.finish(serving)
    ours = [json.loads(line)["response"] for line in open(out / "generations.jsonl")]
    theirs = [json.loads(line) for line in open(served)]
    assert [t["text"] for t in theirs] == ours
    # vLLM's own rendering of each chat (the export's template and processor) is our prompt
    assert [t["prompt_token_ids"] for t in theirs] == [expanded(list(it.prompt.ids), it.prompt.images)
                                                        for it in data.items]
