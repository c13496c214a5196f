"""Which checkpoints a run keeps (checkpoint.keep, checkpoint.keep_every), against lists written
out by hand, and the settings refused in one line."""
import pytest

from zeroflow.config.io import ConfigError, load_config
from zeroflow.trainer.retention import DELETING, delete_steps, remove_leftovers, to_delete

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("steps, newest_verified, keep, keep_every, deleted", [
    ([2, 4, 6, 8], 8, 2, 0, [2, 4]),             # the newest two
    ([2, 4, 6, 8], 8, 1, 4, [2, 6]),             # and every 4th
    ([2, 4, 6, 8, 10, 12], 12, 2, 6, [2, 4, 8]),
    ([2, 4, 6, 8], 6, 1, 0, [2, 4]),             # 8 not verified yet: 6 kept too
    ([5], 5, 1, 0, []),
])
def test_the_steps_let_go(steps, newest_verified, keep, keep_every, deleted):
    assert to_delete(steps, newest_verified, keep, keep_every) == deleted


def test_deleting_renames_first_and_leftovers_are_cleared(tmp_path):
    for step in (1, 2, 3):
        (tmp_path / str(step) / "state").mkdir(parents=True)
    (tmp_path / f"7{DELETING}" / "state").mkdir(parents=True)  # a kill in the middle
    delete_steps(tmp_path, [1, 2, 9])
    remove_leftovers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3"]


@pytest.mark.parametrize("overrides, named", [
    (["checkpoint.keep=0"], "checkpoint.keep must be at least 1"),
    (["checkpoint.every=2", "checkpoint.keep_every=3"], "must be a multiple of checkpoint.every"),
    (["checkpoint.every=0", "checkpoint.keep_every=4"], "must be a multiple of checkpoint.every"),
])
def test_retention_settings_that_cannot_work_are_refused(overrides, named):
    with pytest.raises(ConfigError, match=named):
        load_config(None, overrides)
    assert load_config(None, ["checkpoint.every=2", "checkpoint.keep_every=6"]).checkpoint.keep_every == 6
