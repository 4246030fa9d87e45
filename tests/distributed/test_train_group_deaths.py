"""TrainGroup's call on every rank (driver/workers.py) over a local Ray, with stand-in ranks (Ray
actors that return, raise or exit, not Megatron ranks): a rank that died is named as a RoleDied
even when a live rank's call fails first (its collective lost the peer) or would still run; a
rank's own error is raised as itself, also when it is the last call to end. And the driver's
watch (driver/recovery.RoleWatch): a call that would wait forever on a dead peer outside Ray
ends with a RoleDied naming the dead role; a role killed on purpose is not one."""
from __future__ import annotations

import os
import time

import pytest

from dapo_megatron import roles
from dapo_megatron.driver import workers
from dapo_megatron.driver.workers import TrainGroup


def _stand_in_rank():
    # defined in a function: Ray pickles it by value (workers cannot import this test module)
    class StandInRank:
        def pid(self):
            return os.getpid()

        def call(self, peer, what: str):
            import ray
            return ray.get(peer.act.remote(what, 0.0))

        def act(self, what: str, after_s: float):
            time.sleep(after_s)
            if what == "die":
                os._exit(1)
            if what == "raise":
                raise ValueError("rank error")
            return what
    return StandInRank


def _call(ray, plan):
    ranks = [ray.remote(_stand_in_rank()).options(num_cpus=0).remote() for _ in plan]
    group = TrainGroup(ranks)
    return group._all([r.act.remote(what, after) for r, (what, after) in zip(ranks, plan)])


def test_a_dead_rank_is_named_while_a_live_one_still_runs(local_ray):
    t0 = time.perf_counter()
    with pytest.raises(roles.RoleDied, match=r"^the training rank 1 died: "):
        _call(local_ray, [("ok", 30.0), ("die", 0.2)])
    assert time.perf_counter() - t0 < 20  # not after rank 0's 30 s (Ray's get would wait for it)


def test_a_dead_rank_comes_with_its_handle_and_rays_reason(local_ray):
    """What driver/recovery.keep_roles decides on: the RoleDied carries the dead rank's handle, and
    Ray's GCS says its process died (WORKER_DIED), not its node; `kill` ends the live ones (as
    ray.kill: RAY_KILL). A call past the ranks' (an engine's receive in a sync) names the engine."""
    from dapo_megatron.driver.recovery import death_reason
    ranks = [local_ray.remote(_stand_in_rank()).options(num_cpus=0).remote() for _ in range(2)]
    group = TrainGroup(ranks)
    with pytest.raises(roles.RoleDied) as err:
        group._all([ranks[0].act.remote("ok", 0.0), ranks[1].act.remote("die", 0.2)])
    assert err.value.rank is ranks[1]
    assert death_reason(ranks[1], 20.0) == "WORKER_DIED" and death_reason(ranks[0], 0.5) is None
    engine = local_ray.remote(_stand_in_rank()).options(num_cpus=0).remote()
    with pytest.raises(roles.RoleDied, match=r"^the rollout engine died: ") as err:
        TrainGroup(ranks[:1])._all([ranks[0].act.remote("ok", 0.0), engine.act.remote("die", 0.2)])
    assert getattr(err.value, "rank", None) is None
    group.kill()
    assert death_reason(ranks[0], 20.0) == "RAY_KILL"


def test_a_dead_rank_is_named_when_its_peers_error_comes_first(local_ray, monkeypatch):
    monkeypatch.setattr(workers, "DEATH_GRACE_S", 10.0)
    with pytest.raises(roles.RoleDied, match=r"^the training rank 1 died: "):
        _call(local_ray, [("raise", 0.0), ("die", 1.0)])


def test_a_ranks_own_error_is_itself_also_from_the_last_call(local_ray, monkeypatch):
    monkeypatch.setattr(workers, "DEATH_GRACE_S", 0.5)
    with pytest.raises(ValueError, match="rank error"):
        _call(local_ray, [("ok", 0.0), ("raise", 0.5)])
    with pytest.raises(ValueError, match="rank error"):
        _call(local_ray, [("raise", 0.0), ("ok", 0.2)])
    assert _call(local_ray, [("ok", 0.0), ("fine", 0.1)]) == ["ok", "fine"]


def test_a_call_blocked_on_a_dead_peer_ends_naming_it(local_ray, monkeypatch):
    """The stand-in 'manager' waits forever (as on a dead data plane's ZMQ socket); its peer, a
    stand-in data-plane actor, is killed -9. Without the watch roles.get would never return."""
    import signal

    from dapo_megatron.driver import recovery
    monkeypatch.setattr(roles, "WATCH_S", 0.2)
    monkeypatch.setattr(recovery, "WATCH_GRACE_S", 1.0)
    ray = local_ray
    manager, peer, spare = (ray.remote(_stand_in_rank()).options(num_cpus=0).remote() for _ in range(3))
    pid, _ = ray.get([peer.pid.remote(), spare.pid.remote()])
    watch = recovery.RoleWatch(skip_engines=False)
    ray.kill(spare)  # on purpose: not a death the watch reports
    time.sleep(1.5)
    watch()
    blocked = manager.act.remote("ok", 3600.0)
    roles.set_watch(watch)
    try:
        os.kill(pid, signal.SIGKILL)
        t0 = time.perf_counter()
        with pytest.raises(roles.RoleDied, match=rf"^the StandInRank \(pid {pid}\) died: The actor is dead because its worker process has died; "):
            roles.get("rollout manager", blocked)
        assert time.perf_counter() - t0 < 15
    finally:
        roles.set_watch(None)
        ray.kill(manager)


def test_a_role_whose_peer_died_is_not_named_dead(local_ray):
    """The manager's own call to a peer fails (the peer died): the manager lives, the peer is named."""
    caller, peer = (local_ray.remote(_stand_in_rank()).options(num_cpus=0).remote() for _ in range(2))
    with pytest.raises(roles.RoleDied, match=r"^the actor the rollout manager called died: "):
        roles.get("rollout manager", caller.call.remote(peer, "die"))
    assert roles.get("rollout manager", caller.pid.remote()) > 0  # alive
