"""``headwatch.names``: each concrete name has exactly one declaration, and every consumer agrees on it;
plus the ``headwatch`` dispatcher (``headwatch.cli``) end to end.

The concrete names are listed here by hand where a few suffice, or enumerated with ``expand`` and
then looked up through the other door (``declaration``'s regexes against ``report_group``'s table),
so a declaration that two patterns claim, or a name one lookup knows and the other does not, fails.
"""

from __future__ import annotations

import re

import pytest

from headwatch import names
from headwatch.alerts import RULES
from headwatch.cli import main as cli_main
from headwatch.report import select_tags, tag_group

ALL = [(metric, name) for metric in names.METRICS for name in names.expand(metric)]


def test_every_concrete_name_has_exactly_one_declaration():
    assert len(ALL) > 250  # the placeholders do expand
    for metric, name in ALL:
        claims = [m for m in names.METRICS if m.regex().match(f"headwatch/{name}")]
        assert claims == [metric], name
        assert names.declaration(f"headwatch/{name}") is metric
    concrete = [name for _, name in ALL]
    assert len(concrete) == len(set(concrete))


def test_report_groups_agree_with_the_declaring_monitor():
    by_monitor = {g.monitor: g.name for g in names.GROUPS}
    for metric, name in ALL:
        assert names.report_group(f"headwatch/{name}") == by_monitor[metric.monitor], name
        assert names.report_group(f"run7/{name}", prefix="run7") == by_monitor[metric.monitor]
        assert names.report_group(name) is None  # without the prefix: not a headwatch name


@pytest.mark.parametrize("name", [
    "headwatch/logits/entropyx",
    "headwatch/logits/top2/target_nll",  # no such bucket
    "headwatch/grad/embedding_row_norm_p99",  # no such statistic
    "headwatch/val/logits/entropy/dataloader_idx_x",
    "headwatch/tokens/total/dataloader_idx_1",  # only the {split} metrics take the suffix
    "headwatch/update/head/x_row_density",
    "other/logits/entropy",
    "xheadwatch/logits/entropy",
])
def test_near_misses_are_not_declared(name):
    assert names.declaration(name) is None
    assert names.report_group(name) is None and names.is_headline(name) is None


@pytest.mark.parametrize(("name", "pattern", "group", "headline"), [
    ("headwatch/val/logits/entropy/dataloader_idx_1", "{split}/entropy", "logits", True),
    ("headwatch/val/logits/entropy_p05/dataloader_idx_0", "{split}/entropy_p{q}", "logits", False),
    ("headwatch/val/logits/rare/target_nll/dataloader_idx_12", "{split}/{bucket}/target_nll", "logits", True),
    ("headwatch/logits/entropy_p95/dataloader_idx_2", "{split}/entropy_p{q}", "logits", True),
])
def test_names_of_several_validation_dataloaders(name, pattern, group, headline):
    """Lightning adds ``/dataloader_idx_<k>`` with several validation dataloaders: the same
    declaration, hence the same report group and default selection, as without the suffix."""
    assert names.declaration(name).pattern == pattern
    assert names.report_group(name) == group and tag_group(name) == group
    assert names.is_headline(name) is headline
    assert (select_tags([name]) == [name]) is headline


def test_headline_and_detail():
    assert names.is_headline("headwatch/grad/embedding_row_norm_max") is False  # DETAIL: stat max
    assert names.is_headline("headwatch/grad/embedding_row_norm_p95") is True
    assert names.is_headline("headwatch/grad/top1/head_row_density") is False  # declared headline=False
    assert names.is_headline("hw/logits/entropy_p05", prefix="hw") is False
    assert names.is_headline("headwatch/mine") is None




def test_declared_lists_point_at_declared_names():
    for short in (*names.DEFAULT_ALERT_METRICS, *names.CONSOLE_KEYS):
        assert names.declaration(f"headwatch/{short}") is not None, short
    assert names.PLACEHOLDERS["rule"] == names.ALERT_RULES == RULES
    markers = {name for metric in names.METRICS if metric.monitor == "SharpnessCollapseAlert" for name in names.expand(metric)}
    assert markers == {"alerts"} | {f"alerts/{r}" for r in RULES} | {f"alerts/{r}_warning" for r in RULES}


# --------------------------------------------------------------------------- the dispatcher


def test_headwatch_cost_through_the_dispatcher(capsys):
    # Llama 3 8B (BACKGROUND.md): V = 128,256, d = 4,096, shipped untied with 8,030,261,248 parameters
    argv = ["cost", "--vocab-size", "128256", "--d-model", "4096", "--params", "8030261248", "--no-tied", "--world-size", "8"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "parameters added        525,336,576  (vocab_size * d_model)" in out  # 128256 * 4096
    assert "model, tied             7,504,924,672" in out  # 8,030,261,248 - 525,336,576
    assert "share of untied model   6.54%" in out  # 525,336,576 / 8,030,261,248 = 0.06542
    assert "weights bf16            1,050,673,152 bytes (1.05 GB)" in out
    # bf16 weights and grads + fp32 m, v: 12 bytes; per GPU: 525,336,576 / 8 = 65,667,072 parameters
    assert "6,304,038,912 (6.30 GB)  |  788,004,864 (0.79 GB)" in out


def test_the_dispatcher_reads_sys_argv(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["headwatch", "cost", "--vocab-size", "3", "--d-model", "5"])
    assert cli_main() == 0
    assert "parameters added        15  (vocab_size * d_model)" in capsys.readouterr().out


def test_cost_errors_are_usage_errors(capsys):
    for argv, message in (
        (["cost"], "give --config PATH, or --vocab-size V and --d-model D"),
        (["cost", "--vocab-size", "0", "--d-model", "4"], r"`vocab_size` must be an int in \[1, 2147483647\], got 0"),
        (["cost", "--vocab-size", "10", "--d-model", "4", "--params", "30"], r"`params`=30 is too small for a 10 x 4"),
        (["cost", "--vocab-size", "10", "--d-model", "4", "--params", "70", "--no-tied"], "plus an untied head"),
        (["cost", "--world-size", "0", "--vocab-size", "10", "--d-model", "4"], r"`world_size` must be an int in \[1, 1048576\]"),
    ):
        with pytest.raises(SystemExit) as exc:
            cli_main(argv)
        assert exc.value.code == 2
        assert re.search(message, capsys.readouterr().err), argv
