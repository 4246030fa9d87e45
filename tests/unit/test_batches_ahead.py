"""How far ahead the trainer asks for batches (driver/batches.py): trainer.batches_ahead past the
step, and under trainer.deterministic not past the next save."""
from types import SimpleNamespace

import pytest

from dapo_megatron.config import load_config
from dapo_megatron.driver.batches import Batches


def _asked(overrides: list[str], total: int = 9) -> list[int]:
    """The last step asked for while each step 1..total trains (`take_part`'s first part)."""
    cfg = load_config("quickstart_async", overrides)
    trainer = SimpleNamespace(cfg=cfg, ctx=SimpleNamespace(total_steps=total), step=0)
    asked = []
    for step in range(total):
        trainer.step = step
        asked.append(Batches._ask_until(trainer))
    return asked


@pytest.mark.parametrize("mode,ahead", [(["trainer.mode=one_step_off", "trainer.max_staleness=1"], 1),
                                        (["trainer.partial_rollout=false"], 2)])  # async k=2, drained
def test_a_deterministic_run_asks_nothing_past_a_save(mode, ahead):
    saves = ["trainer.save_freq=3"]
    assert _asked(mode + saves) == [min(s + ahead, 9) for s in range(1, 10)]
    on = _asked(mode + saves + ["trainer.deterministic=true"])
    # step s (1-based) asks up to the next save, or `ahead` past itself when the save is farther
    assert on == [min(s + ahead, -(-s // 3) * 3, 9) for s in range(1, 10)], on
    assert on[2] == 3 and on[3] == min(4 + ahead, 6)  # step 3 is saved before step 4's batch is asked
    assert _asked(mode + ["trainer.save_freq=0", "trainer.deterministic=true"]) == \
        [min(s + ahead, 9) for s in range(1, 10)]  # no save, nothing to drain for
