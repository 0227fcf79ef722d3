"""`headwatch report` groups and default selection derive from headwatch.names."""

from __future__ import annotations

import pytest

from headwatch.report import select_tags, tag_group


@pytest.mark.parametrize(("tag", "group", "shown"), [
    ("headwatch/logits/entropy", "logits", True),
    ("headwatch/val/logits/entropy_p95", "logits", True),
    ("headwatch/val/logits/entropy_p05", "logits", False),  # DETAIL: q = 05
    ("headwatch/grad/embedding_row_norm_max", "gradients", False),  # DETAIL: stat = max
    ("headwatch/update/shared_row_norm_p95", "gradients", True),
    ("headwatch/freq/head_norm_spearman", "gradients", True),
    ("headwatch/grad/rare/head_row_density", "gradients", False),  # a per-bucket declaration
    ("headwatch/collision/tail/embedding_nn_cosine_mean", "collision", False),
    ("headwatch/collision/rare_rate_head", "collision", True),
    ("headwatch/tokens/seen_fraction", "tokens", True),
    ("headwatch/alerts/val_stall_warning", "alerts", True),
    ("headwatch/mine/custom", "other", True),  # undeclared: kept, in its own group
    ("val_loss", "loss", True),
])
def test_groups_and_default_selection_follow_the_declarations(tag, group, shown):
    assert tag_group(tag) == group
    assert (select_tags([tag]) == [tag]) is shown
    assert select_tags([tag], show_all=True) == [tag]


def test_a_new_declaration_is_grouped_and_curated_without_touching_the_report(monkeypatch):
    from headwatch import names

    extra = (names.Metric("logits/new_stat", "nats", "a new statistic", "LogitStatsMonitor"),
             names.Metric("collision/new_detail", "count", "a detail", "SynonymCollisionMonitor", headline=False))
    monkeypatch.setattr(names, "METRICS", names.METRICS + extra)
    names._concrete.cache_clear()
    try:
        assert tag_group("headwatch/logits/new_stat") == "logits"
        assert tag_group("headwatch/collision/new_detail", prefix="headwatch") == "collision"
        assert tag_group("run7/logits/new_stat", prefix="run7") == "logits"  # any prefix
        assert select_tags(["headwatch/logits/new_stat", "headwatch/collision/new_detail"]) == ["headwatch/logits/new_stat"]
    finally:
        monkeypatch.undo()
        names._concrete.cache_clear()
    assert tag_group("headwatch/logits/new_stat") == "other"


def test_every_monitor_has_one_report_group():
    from headwatch import names

    monitors = {m.monitor for m in names.METRICS}
    assert sorted(g.monitor for g in names.GROUPS) == sorted(monitors)
    assert len({g.name for g in names.GROUPS}) == len(names.GROUPS)
