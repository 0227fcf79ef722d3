"""examples/console.py: the example's filter drops Lightning's noise and keeps headwatch's lines and other warnings."""

from __future__ import annotations

import logging
import sys
import warnings

from tests.helpers.paths import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import console  # noqa: E402

RANK_ZERO = logging.getLogger("lightning.pytorch.utilities.rank_zero")


def _kept(message: str) -> bool:
    record = RANK_ZERO.makeRecord(RANK_ZERO.name, logging.INFO, __file__, 1, message, None, None)
    return bool(RANK_ZERO.filter(record))


def test_lightning_banners_are_dropped_and_headwatch_lines_kept():
    console.quiet_third_party()
    console.quiet_third_party()  # idempotent: one filter
    assert RANK_ZERO.filters.count(console._FILTER) == 1
    # the messages Lightning 2.6 sends (lightning/pytorch/trainer/setup.py, logger_connector.py)
    for noise in ("GPU available: False, used: False", "TPU available: False, using: 0 TPU cores",
                  "💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]",
                  "`Trainer(limit_val_batches=1.0)` was configured so 100% of the batches will be used..",
                  "`Trainer.fit` stopped: `max_steps=20` reached."):
        assert not _kept(noise), noise
    for kept in ("headwatch: measuring the logits every 2 steps: the output of the head `lm_head` (Linear); targets ...",
                 "GPU available but not used. You can set it by doing `Trainer(accelerator='gpu')`.",
                 "`Trainer.fit` stopped: `max_epochs=3` reached."):
        assert _kept(kept), kept


def test_only_lightnings_leafspec_deprecation_is_ignored():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        console.quiet_third_party()
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)`",
                      DeprecationWarning)
        warnings.warn("`foo` is deprecated", DeprecationWarning)
    assert [str(w.message) for w in caught] == ["`foo` is deprecated"]
