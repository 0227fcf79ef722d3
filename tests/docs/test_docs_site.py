"""The documentation site: ``mkdocs build --strict`` passes, the metric reference is generated
from ``headwatch.names`` and current, what it says of each front door holds for keys published by tiny
real runs, and the version is one figure everywhere (``pyproject.toml``, ``headwatch.__version__``,
``headwatch --version``, ``CHANGELOG.md``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import headwatch
from headwatch import names
from tests.helpers.paths import ROOT

REFERENCE = ROOT / names.REFERENCE_PATH
MKDOCS_TIMEOUT_S = 300


def _mkdocs(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)]
    return subprocess.run(cmd, cwd=config.parent, env=env, capture_output=True, text=True, timeout=MKDOCS_TIMEOUT_S)


# --------------------------------------------------------------------------- the site builds, strictly


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    start = time.perf_counter()
    done = _mkdocs(ROOT / "mkdocs.yml", tmp_path / "site")
    seconds = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-4000:]
    assert "WARNING" not in done.stderr, done.stderr[-4000:]
    print(f"mkdocs build --strict: {seconds:.1f} s")
    site = tmp_path / "site"
    # the API reference is rendered from the docstrings (one anchor per documented object) ...
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("Headwatch", "LogitStatsMonitor", "SharpnessCollapseAlert", "find_output_head"):
        assert f'id="headwatch.{name}"' in api, name
    hf = (site / "api" / "transformers" / "index.html").read_text(encoding="utf-8")
    assert 'id="headwatch.integrations.transformers.HeadwatchCallback"' in hf
    remedies = (site / "api" / "remedies" / "index.html").read_text(encoding="utf-8")
    assert 'id="headwatch.remedies.untie_output_head"' in remedies
    # ... the metric reference and the changelog are pages of the site
    reference = (site / "reference" / "metrics" / "index.html").read_text(encoding="utf-8")
    assert "headwatch/&lt;split&gt;/renyi2_entropy" in reference
    assert "\\|" not in reference  # an escaped pipe shows as such inside code: no `|` in a declaration's code span
    assert "|{i valid : G_i != 0}| / |valid|" in reference  # outside code it is a pipe
    # a metric's name never breaks mid-name: the page loads the rule that keeps the first column's code whole
    assert 'href="../../stylesheets/headwatch.css"' in reference
    rule = (site / "stylesheets" / "headwatch.css").read_text(encoding="utf-8")
    assert "td:first-child code" in rule and "white-space: nowrap" in rule and "word-break: keep-all" in rule
    changelog = (site / "changelog" / "index.html").read_text(encoding="utf-8")
    assert f"[{headwatch.__version__}]" in changelog and "Keep a Changelog" in changelog


def test_a_link_out_of_the_site_fails_the_strict_build(tmp_path):
    """The validation settings of mkdocs.yml make a link to a file outside docs/ (the pages' old
    ``../tests/x.py`` links) and a missing image errors; the same page without them builds."""
    pytest.importorskip("mkdocs")
    import yaml

    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=yaml.BaseLoader)
    mini = {"site_name": "t", "docs_dir": "docs", "strict": "true", "validation": config["validation"], "nav": ["index.md"]}
    (tmp_path / "docs").mkdir()
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(mini), encoding="utf-8")
    for page, ok in (("See [the test](../tests/test_x.py).", False), ("![a picture](missing.png)", False), ("See `tests/test_x.py`.", True)):
        (tmp_path / "docs" / "index.md").write_text(f"# t\n\n{page}\n", encoding="utf-8")
        done = _mkdocs(tmp_path / "mkdocs.yml", tmp_path / "site")
        assert (done.returncode == 0) is ok, (page, done.stderr[-2000:])
        if not ok:
            assert "not found among documentation files" in done.stderr


def test_every_page_and_image_of_docs_is_reachable():
    """A page in docs/ that nav leaves out would be an orphan (the strict build warns too: checked here
    without a build); every image a page shows is in docs/."""
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = set(re.findall(r"^\s+(?:- )?[^#\n]*?:\s+([\w/.-]+\.md)\s*$", text, re.M)) | set(re.findall(r"- (\w+\.md)$", text, re.M))
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert pages <= nav, f"pages missing from nav: {sorted(pages - nav)}"
    assert nav <= pages, f"nav names missing pages: {sorted(nav - pages)}"
    for page in (ROOT / "docs").rglob("*.md"):
        for image in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            assert (page.parent / image).is_file(), (page, image)


# --------------------------------------------------------------------------- the metric reference


def test_the_committed_metric_reference_is_current(tmp_path):
    assert REFERENCE.read_text(encoding="utf-8") == names.reference_page(), (
        "stale: run python -m headwatch.names --reference docs/reference/metrics.md"
    )
    assert names.main(["--reference", str(REFERENCE), "--check"]) == 0
    stale = tmp_path / "metrics.md"
    stale.write_text(names.reference_page().replace("| mean top-1 probability;", "| hand-edited;"), encoding="utf-8")
    before = stale.read_text(encoding="utf-8")
    assert names.main(["--reference", str(stale), "--check"]) == 1  # stale, and left as it was
    assert stale.read_text(encoding="utf-8") == before
    assert names.main(["--reference", str(stale)]) == 0  # rewritten
    assert stale.read_text(encoding="utf-8") == names.reference_page()
    with pytest.raises(SystemExit):
        names.main([])


def _rows() -> dict[str, list[str]]:
    """The reference's table rows, by key (``headwatch/<pattern with <placeholders>>``), split into cells."""
    rows = {}
    for line in REFERENCE.read_text(encoding="utf-8").splitlines():
        if line.startswith("| `headwatch/"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            assert cells[0] not in rows, f"two rows for {cells[0]}"
            rows[cells[0].strip("`")] = cells
    return rows


def test_the_reference_has_one_row_per_declaration_with_its_fields():
    rows = _rows()
    keys = {"headwatch/" + re.sub(r"\{(\w+)\}", r"<\1>", m.pattern): m for m in names.METRICS}
    assert set(rows) == set(keys)  # every declaration a row, every row a declaration
    for key, metric in keys.items():
        cells = rows[key]
        assert len(cells) == 5, key
        assert cells[1] == metric.unit, key
        for part in (metric.definition, metric.formula, metric.source):
            assert part.replace("|", "\\|") in cells[2], (key, part)
        assert cells[3] == names.steps_of(metric), key
    # the row of one declaration, written out by hand
    assert rows["headwatch/<split>/renyi2_entropy"][1:] == [
        "nats",
        "mean Rényi entropy of order 2 (collision entropy): minus the log-probability that two independent draws from "
        "`p` agree; in `[0, H(p)]`, it weighs the large probabilities and barely sees the tail; "
        "`H_2(p) = -log sum_v p_v^2` (`-inf` logits add 0) (Rényi 1961)",
        "logging steps; `val`: each validation epoch or evaluation",
        "all; `val`: Lightning, HF",
    ]
    assert rows["headwatch/rl/temperature"][3:] == ["logging steps of an RL run (GRPO, RLOO)", "HF"]
    assert rows["headwatch/grad/tying"][4] == "all"
    assert rows["headwatch/collision/val/synonym_confusion_rate"][3:] == [
        "each validation epoch or evaluation (`synonym_groups=`)", "Lightning, HF"
    ]


# --------------------------------------------------------------------------- each door's keys, both ways

V, D = 64, 16
SYNONYMS = [[1, 2, 3], [4, 5]]
HF_TIES = (True,)  # a tied model publishes every declaration (the shared flow, the tied split); one Trainer run
# published only when an alert fires, an action fails or the disk does (tests/alerts/,
# tests/tensorboard/test_storage_faults.py read them back), or by TRL's trainers (RL:
# tests/integrations/transformers/test_rl_grpo.py; entropy and accuracy gaps: tests/core/test_self_check.py)
NOT_IN_A_TINY_RUN = {"SharpnessCollapseAlert", "AlertEngine", "GuardedFileWriter"}


def _needs_trl(metric: names.Metric) -> bool:
    return metric.pattern.startswith("rl/") or metric.pattern in ("check/entropy_gap", "check/accuracy_gap")


def _tiny_llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tie)  # fmt: skip
    return LlamaForCausalLM(config)


def _monitors():
    from headwatch.core import GradientDensity, LogitStats, SynonymCollision, TokenCounts

    counts = TokenCounts()
    return [
        counts,
        LogitStats(vocab_size=60, frequency=counts, figure_every=1),  # 4 padded columns: padded_mass
        GradientDensity(frequency=counts, figure_every=1),
        SynonymCollision(frequency=counts, synonym_groups=SYNONYMS, tau=-1.0, figures=True),  # every pair collides: top_pairs
    ]  # core objects keep their own figure settings (figure_every_n_steps= sets those built from names)


def _tags(log_dir: Path) -> set[str]:
    """Every tag of every event file under ``log_dir``: scalars, histograms, images, text."""
    tags: set[str] = set()
    for events in {p.parent for p in log_dir.rglob("events.out.tfevents.*")}:
        acc = EventAccumulator(str(events), size_guidance={"images": 0, "histograms": 0, "tensors": 0, "scalars": 0})
        acc.Reload()
        t = acc.Tags()
        tags |= set(t["scalars"]) | set(t["histograms"]) | set(t["images"]) | {x.removesuffix("/text_summary") for x in t["tensors"]}
    return tags


def _hf_keys(tmp_path: Path) -> set[str]:
    """What the Hugging Face door publishes (its TensorBoard events: ``train/...``, ``eval/...``) over two
    logging steps and one evaluation of a tied model."""
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from headwatch.integrations.transformers import HeadwatchCallback
    from tests.helpers import TokenDataset

    keys: set[str] = set()
    for tie in HF_TIES:
        out = tmp_path / f"hf_{tie}"
        args = TrainingArguments(
            output_dir=str(out), max_steps=2, logging_steps=1, per_device_train_batch_size=4, learning_rate=1e-2,
            report_to="tensorboard", use_cpu=True, save_strategy="no", disable_tqdm=True, eval_strategy="steps",
            eval_steps=2, per_device_eval_batch_size=4,
        )  # fmt: skip
        callback = HeadwatchCallback(monitors=_monitors(), figure_every_n_steps=1)
        data, held_out = TokenDataset(n=8), TokenDataset(n=4, seed=1)
        Trainer(model=_tiny_llama(tie), args=args, train_dataset=data, eval_dataset=held_out, callbacks=[callback]).train()
        keys |= {re.sub(r"^(train|eval)/", "", t) for t in _tags(out)}
    return keys


def _loop_keys(tmp_path: Path) -> set[str]:
    """What the plain loop publishes to its SummaryWriter over two logging steps, tied and untied."""
    from torch.utils.tensorboard import SummaryWriter

    from headwatch import Headwatch
    from headwatch.core import Schedule
    from tests.helpers import TokenDataset

    keys: set[str] = set()
    data = TokenDataset(n=8)
    batch = {"input_ids": data.input_ids, "attention_mask": data.attention_mask, "labels": data.labels}
    for tie in (False, True):
        model, writer = _tiny_llama(tie), SummaryWriter(str(tmp_path / f"loop_{tie}"))
        hw = Headwatch(model, monitors=_monitors(), writer=writer, log_every_n_steps=1, figure_every_n_steps=1)
        for monitor in hw.monitors:
            monitor.configure(Schedule(1))  # collision on every step too
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        for step in range(2):
            hw.step_start(batch, step)
            loss = model(**batch).loss
            loss.backward()
            hw.before_optimizer_step()
            optimizer.step()
            hw.after_optimizer_step()
            hw.step_end(loss=loss)
            optimizer.zero_grad()
        hw.close()
        writer.close()
        keys |= _tags(tmp_path / f"loop_{tie}")
    return keys


def _claims(door: str) -> set[tuple[str, bool]]:
    """(pattern, validation?) of every declaration the reference says ``door`` publishes (a ``{split}``
    declaration stands for two claims: its training and its validation names)."""
    claims = set()
    for metric, name in ((m, n) for m in names.METRICS for n in names.expand(m)):
        if door in names.doors_of(metric, name) and metric.monitor not in NOT_IN_A_TINY_RUN and not _needs_trl(metric):
            claims.add((metric.pattern, name.startswith(("val/", "collision/val/"))))
    return claims


@pytest.mark.parametrize("door", ["hf", "loop"])
def test_each_door_publishes_what_the_reference_says_and_nothing_undeclared(tmp_path, door):
    """Both ways, from a tiny real run of the door (the Lightning door: tests/core/test_core.py,
    test_every_emitted_name_is_declared_and_documented): every published key has a declaration that names
    this door, and every declaration the reference gives this door is published (its training and its
    validation names apart)."""
    keys = _hf_keys(tmp_path) if door == "hf" else _loop_keys(tmp_path)
    ours = {k for k in keys if k.startswith("headwatch/")}
    assert ours and keys - ours <= {
        "custom_scalars__config__", "args", "model_config", "loss", "grad_norm", "learning_rate", "epoch", "total_flos",
        "train_loss", "train_runtime", "train_samples_per_second", "train_steps_per_second", "runtime", "samples_per_second",
        "steps_per_second",
    }, sorted(keys - ours)  # fmt: skip
    published = set()
    for key in ours:
        metric = names.declaration(key)
        assert metric is not None, f"published, not declared: {key}"
        short = key.removeprefix("headwatch/")
        assert door in names.doors_of(metric, short), f"published by {door}, the reference says {names.doors_of(metric, short)}: {key}"
        published.add((metric.pattern, short.startswith(("val/", "collision/val/"))))
    missing = sorted(_claims(door) - published)
    assert not missing, f"the reference says {door} publishes these, a run did not: {missing}"


def test_doors_of_validation_names_and_overrides():
    by_pattern = {m.pattern: m for m in names.METRICS}
    entropy = by_pattern["{split}/entropy"]
    assert names.doors_of(entropy, "logits/entropy") == ("lightning", "hf", "loop")
    assert names.doors_of(entropy, "val/logits/entropy") == ("lightning", "hf")  # the plain loop has no validation
    assert names.doors_of(by_pattern["rl/temperature"]) == ("hf",)
    assert names.doors_of(by_pattern["check/entropy_gap"]) == ("hf",)
    assert names.doors_of(by_pattern["grad/tying"]) == ("lightning", "hf", "loop")
    assert names.steps_of(by_pattern["collision/synonym_pairs"]) == "collision steps (`synonym_groups=`)"
    assert names.steps_of(by_pattern["collision/nn_similarity_{m}"]) == "collision steps (`figures=`)"
    assert names.steps_of(by_pattern["grad/row_norm_vs_frequency"]) == "figure steps"


# --------------------------------------------------------------------------- the version


def test_one_version_everywhere(capsys):
    from headwatch.cli import main

    assert headwatch.__version__ == "0.3.0"
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")  # (no tomllib on Python 3.10)
    project = pyproject.split("\n[project]\n", 1)[1].split("\n[", 1)[0]  # the [project] table
    assert re.search(r'^dynamic = \["version"\]', project, re.M) and not re.search(r"^version = ", project, re.M)
    assert re.search(r'^\[tool\.setuptools\.dynamic\]\nversion = \{ attr = "headwatch\.__version__" \}$', pyproject, re.M)
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"headwatch {headwatch.__version__}\n"
    # the command as a process (``python -m headwatch`` runs the console script's function)
    done = subprocess.run([sys.executable, "-m", "headwatch", "--version"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})  # fmt: skip
    assert done.stdout == f"headwatch {headwatch.__version__}\n", done.stderr
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    released = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", changelog, re.M)
    assert [v for v, _ in released][:3] == [headwatch.__version__, "0.2.0", "0.1.0"]  # newest first
    assert [d for _, d in released] == sorted((d for _, d in released), reverse=True)
