"""A Ray node lost mid-run: the run restarts itself, waits for the devices, and goes on.

Two Ray nodes on this machine (Ray's own `cluster_utils.Cluster`: a head and a node, each its
own raylet, as `ray start --head` + `ray start --address` would make them): the head holds no CPU
(the driver and, beside it, the rollout manager, which asks none), the node holds every CPU, so
the training ranks, the engine and the data plane all run on it. The node is killed (its raylet
and workers, SIGKILL) once step 1 is saved; the run restarts under trainer.max_restarts, its
placement group waits with a line on the console, a node with the same CPUs joins, and the run
finishes from its last checkpoint.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time

import pytest

from tests.e2e.test_driver import MAIN, _overrides, _rows

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NODE_CPUS = 4  # the 2 ranks (their engine shares their bundles) + the data plane's controller and unit


def _start_cluster():
    from ray.cluster_utils import Cluster

    from dapo_megatron import dataplane
    os.environ.update(dataplane.process_env(), RAY_DISABLE_USAGE_STATS="1")  # the nodes' processes inherit it
    # A dead node is declared after 3 missed health checks a second apart (Ray's default: 5 x 3 s).
    health = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                             "_system_config": health})
    return cluster, cluster.add_node(num_cpus=NODE_CPUS)


def test_a_lost_node_restarts_the_run_when_it_comes_back(tiny_assets, tmp_path):
    out = tmp_path / "run"
    cluster, node = _start_cluster()
    lines: list[str] = []
    try:
        env = {**os.environ, "RAY_ADDRESS": cluster.address}
        overrides = _overrides(tiny_assets, out, 3, **{"trainer.test_freq": 0, "trainer.max_restarts": 1,
                                                       "trainer.placement_timeout_s": 300})
        proc = subprocess.Popen([*MAIN, *overrides], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()

        def wait_for(pattern: str, timeout: float = 300) -> None:
            deadline = time.monotonic() + timeout
            while not any(re.search(pattern, line) for line in list(lines)):
                assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
                time.sleep(0.1)

        wait_for(r"^saved \S*step_1$")
        lost_at = time.monotonic()
        cluster.remove_node(node, allow_graceful=False)  # kill -9 of its raylet and every worker on it
        wait_for(r"^placement: waiting \d+ s for 2 x CPU \(0 free of 0 on 1 alive node\)")
        waited = time.monotonic() - lost_at
        cluster.add_node(num_cpus=NODE_CPUS)  # the node comes back (or another takes its place)
        assert proc.wait(timeout=600) == 0, "".join(lines)[-3000:]
        reader.join()
    finally:
        if proc.poll() is None:
            proc.kill()
        cluster.shutdown()
    console = "".join(lines)
    (tmp_path / "console.txt").write_text(console)
    assert waited < 60, console[-3000:]  # the death is seen, and said, within seconds
    # What the driver saw first: the rollout manager (on the head) failing its call to a role on the
    # lost node, a training rank's call, or its watch finding the node's actors dead (Ray's GCS)
    # while the manager waited on the lost data plane.
    restart = re.search(r"(the Ray node \w+ died, and with it the |the training rank \d died: |the actor the "
                        r"rollout manager called died: ).*: restart 1 of trainer.max_restarts=1, from ", console)
    assert restart, console[-3000:]
    events = [json.loads(line) for line in open(out / "events.jsonl")]
    assert [e["event"] for e in events] == ["restart"], events
    resumed = events[0]["step"]  # 1, or 2 when step 2 was saved before the node's death was seen
    assert resumed >= 1 and events[0]["checkpoint"] == str(out / "checkpoints" / f"step_{resumed}")
    assert f"resumed from {out / 'checkpoints' / f'step_{resumed}'} at step {resumed}" in console, console[-3000:]
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]  # no step lost or trained twice
    # Each step took exactly the prompts it generated from the stream, across the lost node too.
    consumed = [r["data/prompts_consumed"] for r in rows]
    gen = [r["sampling/generated_groups"] for r in rows]
    assert consumed == [sum(gen[:i + 1]) for i in range(3)], (consumed, gen)
    assert all(r["rollout/logprob_diff_max"] < 1e-2 for r in rows)  # the new node's engine got the weights
