"""The headwatch tab's backend without a server: TensorBoard's own data provider in-process over event files
written here, the collision table's parser on awkward tokens, and what the plugin module imports.

(``tests/test_browser.py`` runs the same routes in a real ``tensorboard`` process and a real browser.)
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from headwatch.tensorboard.charts import PANELS
from headwatch.integrations.tensorboard_plugin import data, verdicts

ROOT = Path(__file__).resolve().parents[2]


def provider_of(logdir: Path):
    """TensorBoard's Python data provider (the one ``--load_fast=false`` serves) over ``logdir``."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer

    multiplexer = plugin_event_multiplexer.EventMultiplexer(tensor_size_guidance={"text": 0, "scalars": 0})
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    return data_provider.MultiplexerDataProvider(multiplexer, str(logdir)), context.RequestContext()


@pytest.mark.parametrize("tags, prefix", [
    (["headwatch/logits/entropy", "headwatch/grad/head_row_density", "train_loss"], "headwatch"),
    (["train/headwatch/logits/entropy", "train/headwatch/val/logits/entropy", "train/loss"], "train/headwatch"),
    (["hw/run1/logits/entropy", "hw/run1/collision/rare_rate_head", "hw/run1/x"], "hw/run1"),
    (["loss", "accuracy"], None),
])  # fmt: skip
def test_run_prefix(tags, prefix):
    assert data.run_prefix(tags) == prefix


AWKWARD = ["a|b", "`tick`", "it's", 'say "hi"', "tab\there", "new\nline", "é\u202e", "\\"]


def test_the_collision_table_parser_reads_back_every_decoded_token():
    # the rows as the collision monitor writes them (core/collision.py: `{id} `{text!r}``, counts, cosines)
    rows = [f"| {i} `{t!r}` | {i + 1} | {i + 10} `{t[::-1]!r}` | 0 | {0.9 + i / 100:.4f} | {0.99:.4f} |" for i, t in enumerate(AWKWARD)]
    text = "\n".join(["| rare token | count | nearest row | count | cosine (drift removed) | raw cosine |", "|---|---|---|---|---|---|", *rows])
    parsed = data.parse_pairs_table(text + "\n\nnot paired: 3 never-seen rows")
    assert [p["text"] for p in parsed["pairs"]] == AWKWARD
    assert [p["neighbour_text"] for p in parsed["pairs"]] == [t[::-1] for t in AWKWARD]
    assert [(p["token"], p["count"], p["neighbour"], p["neighbour_count"]) for p in parsed["pairs"]] == [
        (i, i + 1, i + 10, 0) for i in range(len(AWKWARD))]
    assert [p["cosine"] for p in parsed["pairs"]] == [round(0.9 + i / 100, 4) for i in range(len(AWKWARD))]
    assert parsed["note"] == "not paired: 3 never-seen rows" and parsed["tau"] is None
    empty = data.parse_pairs_table("no rare token collides at tau = 0.9\n\nnot paired: 1 never-seen")
    assert empty == {"pairs": [], "tau": 0.9, "note": "not paired: 1 never-seen"}


def test_routes_read_the_values_written_through_tensorboards_provider(tmp_path):
    writer = SummaryWriter(str(tmp_path / "run"))
    values = {"train/headwatch/logits/entropy": [5.0, 4.0, float("nan")], "train/headwatch/logits/kl_to_uniform": [1.0, 2.0, 3.0],
              "train/headwatch/grad/head_row_density": [1.0, 1.0, 1.0], "train/loss": [6.0, 5.5, 5.25]}  # fmt: skip
    for tag, series in values.items():
        for step, v in enumerate(series):
            writer.add_scalar(tag, v, step)
    for tag, v in (("alerts/entropy_floor_warning", 1.0), ("alerts/entropy_floor", 1.0), ("alerts/kl_ceiling", 1.0)):
        writer.add_scalar(f"train/headwatch/{tag}", v, 2)
    # two messages at one step under one tag, then one rule whose marker came without a message
    writer.add_text("train/headwatch/alerts", "[warning] headwatch sharpness collapse alert (entropy_floor, warning): low", 2)
    writer.add_text("train/headwatch/alerts", "[critical] headwatch sharpness collapse alert (entropy_floor): lower", 2)
    writer.close()
    provider, ctx = provider_of(tmp_path)
    (listed,) = data.list_runs(provider, ctx, "")
    assert listed == {"run": "run", "prefix": "train/headwatch", "rl": False, "synonyms": False, "alerts": True, "collision": False}
    answer = data.vitals(provider, ctx, "", "run")
    entropy, nll, density, collision = answer["panels"]
    assert [p["key"] for p in answer["panels"]] == [p.key for p in PANELS]
    by_label = {s["label"]: s for s in entropy["series"]}
    assert by_label["entropy, train (mean)"]["points"] == [[0, 5.0], [1, 4.0], [2, None]]  # NaN as null, kept
    assert by_label["log V: uniform (entropy + KL(p ‖ U))"]["points"] == [[0, 6.0], [1, 6.0], [2, None]]
    assert {s["label"]: s["points"] for s in nll["series"]} == {"the trainer's loss, train": [[0, 6.0], [1, 5.5], [2, 5.25]]}
    assert [s["label"] for s in density["series"]] == ["head, scoring flow"] and density["reference"]["value"] == 1.0
    assert collision["series"] == []
    alerts = data.alerts(provider, ctx, "", "run")
    assert [(a["step"], a["rule"], a["severity"], a["message"]) for a in alerts["alerts"]] == [
        (2, "entropy_floor", "critical", "headwatch sharpness collapse alert (entropy_floor): lower"),
        (2, "entropy_floor", "warning", "headwatch sharpness collapse alert (entropy_floor, warning): low"),
        (2, "kl_ceiling", "critical", None),
    ]
    assert alerts["alerts"][2]["note"].startswith("another alert's message holds this step")
    assert alerts["last_step"] == 2


def test_the_plugin_imports_without_torch_and_is_declared_as_an_entry_point():
    code = "import sys, headwatch.integrations.tensorboard_plugin as p, headwatch.integrations.tensorboard_plugin.data; print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert project["project"]["entry-points"]["tensorboard_plugins"] == {"headwatch": "headwatch.integrations.tensorboard_plugin:HeadwatchPlugin"}
    assert project["tool"]["setuptools"]["package-data"]["headwatch.integrations.tensorboard_plugin"] == ["static/*.js", "static/*.css"]
    static = ROOT / "src/headwatch/integrations/tensorboard_plugin/static"
    assert {p.name for p in static.iterdir()} >= {"index.js", "style.css"}


