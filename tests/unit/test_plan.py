"""The memory plan (dapo_megatron/plan): every shipped config plans without a device or the
network, impossible layouts are refused naming the key, the boundary sits at the device's memory,
and the start-up check refuses before Ray starts. The exact state bytes are checked against
Megatron's allocations in tests/distributed (test_actor.py, test_actor_offload.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dapo_megatron.config import ConfigError, available_configs, load_config
from dapo_megatron.plan import GiB, check, make_plan, render
from dapo_megatron.plan.__main__ import SHIPPED_SHAPES, main, model_spec

QWEN3_30B = str(SHIPPED_SHAPES / "Qwen3-30B-A3B-Base.json")
EIGHT_H100 = ["trainer.nnodes=1", "trainer.n_gpus_per_node=8", "data.max_response_length=8192"]


def plan_of(name: str, overrides: list[str], memory_gb: float):
    cfg = load_config(name, overrides)
    return make_plan(cfg, model_spec(cfg, QWEN3_30B if not cfg.model.path else ""), memory_gb * GiB)


def layout(tp: int, ep: int, *extra: str) -> list[str]:
    keys = [f"{role}.parallel.{k}={v}" for role in ("actor", "ref") for k, v in (("tp", tp), ("ep", ep))]
    return EIGHT_H100 + keys + list(extra)


@pytest.mark.parametrize("name", [n for n in available_configs() if "30b" in n or n == "dapo"])
def test_every_30b_config_plans_offline(name, capsys):
    """No device, no Ray, no download: the shape comes from configs/hf/ (dapo.yaml names no model)."""
    rc = main(["-cn", name, "--device-memory-gb", "64" if "npu" in name else "80"]
              + (["--hf-config", QWEN3_30B] if name == "dapo" else []))
    out = capsys.readouterr()
    assert rc in (0, 1), out.err
    assert "peak:" in out.out and "update" in out.out and "optimizer" in out.out
    if name != "dapo":  # the shipped layouts fit their hardware
        assert rc == 0 and "fits" in out.out, out.out


def test_tiny_configs_plan_from_their_assets(tiny_assets, capsys):
    rc = main(["-cn", "quickstart", f"model.path={tiny_assets / 'qwen3_moe'}", "--device-memory-gb", "16"])
    assert rc == 0 and "fits" in capsys.readouterr().out
    # the recipe's 22.5k-token sequences on a CPU: the unfused attention keeps heads x S^2 floats a layer
    rc = main(["-cn", "dapo", f"model.path={tiny_assets / 'qwen2'}", "--device-memory-gb", "16"])
    out = capsys.readouterr()
    assert rc == 1 and "DOES NOT FIT" in out.out and "actor.max_tokens_per_microbatch" in out.err


def test_tp1_ep1_without_offload_on_8_h100_is_refused_naming_a_key():
    plan = plan_of("qwen3_30b_a3b_megatron_gpu", layout(1, 1, "actor.offload.params=false",
                                                       "actor.offload.grads=false", "actor.offload.optimizer=false"), 80)
    assert not plan.fits and plan.peak.total > 2 * 80 * GiB
    with pytest.raises(ConfigError) as err:
        check(plan)
    assert err.value.key == "actor.offload.grads" and "generate" in str(err.value)  # the largest term while generating


def test_the_boundary_is_the_device_memory():
    """A layout the plan puts 10% over one device is refused; with 5% headroom it starts."""
    cfg = load_config("qwen3_30b_a3b_megatron_gpu", [])
    spec = model_spec(cfg)
    peak = make_plan(cfg, spec, 80 * GiB).peak.total
    over, under = make_plan(cfg, spec, peak / 1.10), make_plan(cfg, spec, peak / 0.95)
    with pytest.raises(ConfigError) as err:
        check(over)
    assert err.value.key in ("actor.max_tokens_per_microbatch", "trainer.nnodes", "rollout.gpu_memory_utilization")
    check(under)


def test_peer_layouts_fit_with_the_cpu_optimizer():
    """slime's TP4 x EP8 and verl's GSPO TP2 x EP8 on 8 x 80 GB keep Adam in host memory for the
    whole update (Megatron's CPU optimizer). With actor.offload.optimizer alone, which moves it out
    only while the engines generate, the plan puts both over, by less than the optimizer term; with
    actor.optim.cpu_offload they fit, the device keeping 1 - cpu_offload_fraction of the optimizer."""
    cpu = ["actor.optim.cpu_offload=true", "actor.offload.optimizer=false"]
    for tp in (4, 2):
        engines = [f"rollout.parallel.tp={tp}", f"rollout.parallel.ep={tp}"]
        plan = plan_of("qwen3_30b_a3b_megatron_gpu", layout(tp, 8, *engines), 80)
        update = next(p for p in plan.phases if p.name == "update")
        assert not plan.fits and update.total > 80 * GiB  # (their resume, reading Adam once more, too)
        assert update.total - update.terms["optimizer"] < 80 * GiB
        generate = next(p for p in plan.phases if p.name == "generate")
        assert "optimizer" not in generate.terms and "params" not in generate.terms  # offloaded
        host = plan_of("qwen3_30b_a3b_megatron_gpu", layout(tp, 8, *engines, *cpu), 80)
        half = plan_of("qwen3_30b_a3b_megatron_gpu", layout(tp, 8, *engines, *cpu, "actor.optim.cpu_offload_fraction=0.5"), 80)
        assert host.fits, render(host)
        by, by_half = ({p.name: p for p in x.phases} for x in (host, half))
        assert by["update"].terms["optimizer"] == 0 and by["resume"].terms["checkpoint load"] == 0
        assert by_half["update"].terms["optimizer"] == pytest.approx(update.terms["optimizer"] / 2)
        assert by["update"].total == pytest.approx(update.total - update.terms["optimizer"])
        note = next(n for n in host.notes if "CPU optimizer" in n)
        assert f"{update.terms['optimizer'] * 1.5 / GiB:.1f} GiB per actor rank in host memory" in note


def test_a_runs_first_moments_are_planned_in_the_order_the_code_follows():
    """start-up, resume and restart hold the actor's whole state while the engines sleep
    (driver/moments.Moments.start): with the engines awake (free_cache_engine off) start-up adds their share.
    The NPU text config peaks in its resume (the optimizer state read once more, the gradients
    offloaded first): a device between its update and its resume is refused, naming a key, though
    a plan of the step's phases alone would have passed it."""
    gpu = plan_of("qwen3_30b_a3b_megatron_gpu", [], 80)
    by = {p.name: p for p in gpu.phases}
    assert list(by) == ["start-up", "resume", "restart", "generate", "log-probs", "update", "weight sync",
                        "engine replacement"]
    assert "engine replacement" in by and "engine share" in by["engine replacement"].terms
    start = by["start-up"]
    assert start.terms.keys() == {"params", "grads", "optimizer", "runtime"}
    assert start.terms == by["restart"].terms and start.total < by["update"].total
    assert "grads" not in by["resume"].terms and by["resume"].terms["checkpoint load"] == start.terms["optimizer"]
    # the engines created awake and never put to sleep: the old start-up, share and whole state at once
    awake = {p.name: p for p in plan_of("qwen3_30b_a3b_megatron_gpu", ["rollout.free_cache_engine=false"], 80).phases}
    assert awake["start-up"].total == pytest.approx(start.total + awake["generate"].terms["engine share"])
    assert awake["start-up"].total > 80 * GiB
    npu = plan_of("qwen3_30b_a3b_megatron_npu", [], 64)
    by = {p.name: p for p in npu.phases}
    assert npu.peak.name == "resume" and by["update"].total < by["resume"].total
    between = (by["update"].total + by["resume"].total) / 2 / GiB
    tight = plan_of("qwen3_30b_a3b_megatron_npu", [], between)
    steps_only = [p for p in tight.phases if p.name in ("generate", "log-probs", "update", "weight sync")]
    assert max(p.total for p in steps_only) <= between * GiB
    with pytest.raises(ConfigError) as err:
        check(tight)
    assert "the resume phase" in str(err.value) and err.value.key == "trainer.nnodes"
    # without restarts configured, no restart phase; split placement has no engine replacement on its devices
    plain = [p.name for p in plan_of("qwen3_30b_a3b_megatron_gpu", ["trainer.max_restarts=0",
                                                                    "rollout.max_engine_restarts=0"], 80).phases]
    assert "restart" not in plain and "engine replacement" not in plain and "start-up" in plain


def test_activation_terms_follow_the_keys_that_shrink_them():
    base = plan_of("qwen3_30b_a3b_megatron_gpu", [], 80).per_rank
    half = plan_of("qwen3_30b_a3b_megatron_gpu", ["actor.max_tokens_per_microbatch=11264",
                                                  "data.max_response_length=9216"], 80).per_rank
    assert half["logits"] == pytest.approx(base["logits"] / 2) and half["activations"] < base["activations"]
    selective = plan_of("qwen3_30b_a3b_megatron_gpu", ["actor.recompute_granularity=selective"], 80).per_rank
    assert selective["activations"] > 5 * base["activations"]  # full keeps each layer's input only
    tp4 = plan_of("qwen3_30b_a3b_megatron_gpu", [f"{r}.parallel.tp=4" for r in ("actor", "ref")], 80).per_rank
    assert tp4["logits"] == pytest.approx(base["logits"] / 2, rel=1e-3) and tp4["params"] < base["params"]


def test_a_model_dir_without_config_is_one_error_naming_the_key(tmp_path, capsys):
    assert main(["-cn", "quickstart", f"model.path={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "model.path" in err and "--hf-config" in err


def test_start_up_refuses_before_ray(tiny_assets, monkeypatch, capsys):
    """main -> prepare -> check_memory: an impossible layout exits 2 naming the key; Ray never
    started. trainer.skip_memory_check=true turns the refusal into a warning."""
    import ray

    from dapo_megatron import main as entry
    from dapo_megatron.driver import setup
    monkeypatch.setattr(setup, "init_ray", lambda cfg: pytest.fail("Ray started despite the plan"))
    args = ["--config-name", "quickstart", f"model.path={tiny_assets / 'qwen3_moe'}",
            f"data.train_files=[{tiny_assets / 'data' / 'train.parquet'}]", "data.val_files=[]",
            "trainer.device_memory_gb=0.001", f"trainer.default_local_dir={tiny_assets.parent / 'run'}"]
    assert entry.main(args) == 2
    err = capsys.readouterr().err
    assert "memory plan" in err and "change " in err and not ray.is_initialized()
    cfg = load_config("quickstart", args[2:] + ["trainer.skip_memory_check=true"])
    with pytest.warns(UserWarning, match="skip_memory_check"):
        setup.check_memory(cfg, model_spec(cfg))


def test_shipped_shapes_are_the_models_they_name():
    configs = [p for p in Path(SHIPPED_SHAPES).glob("*.json") if not p.name.endswith(".tensors.json")]
    assert len(configs) == 2
    for path in configs:
        hf = json.loads(path.read_text())
        text = hf.get("text_config", hf)
        assert (text["hidden_size"], text["num_hidden_layers"], text["num_experts"]) == (2048, 48, 128), path.name
