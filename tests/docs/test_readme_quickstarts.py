"""The README's three quick starts, run as written, offline.

Each test reads one ``python`` block of README.md's "Quick start" section and executes it in a fresh
namespace, in a temporary working directory, with the downloads replaced: ``from_pretrained`` of the
tokenizer and the model give a word-level tokenizer and a tiny tied ``LlamaForCausalLM`` (the family of
SmolLM2), and ``datasets.load_dataset`` gives a small in-memory text dataset. Only the run length is
shortened (each replacement must match the README exactly once, so a changed program fails here).

The reference for each door is outside headwatch: the trainer's own loss of the same step. With one
step per logging interval, headwatch's ``logits/target_nll`` (the NLL of the logging step's batch) must
equal the Trainer's logged ``loss`` (Hugging Face), the ``train_loss`` the LightningModule logs
(Lightning), and the loop's own ``loss`` (plain loop), each to 1e-5; the entropy must lie in ``[0, log V]``.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

README = ROOT / "README.md"
WORDS = [f"w{i}" for i in range(60)]
V = len(WORDS) + 3  # + <pad>, <eos>, <unk>


def quickstart(heading: str) -> str:
    """The first ``python`` block after ``### <heading>`` inside README.md's ``## Quick start``."""
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    part = section.split(f"\n### {heading}\n", 1)[1]
    match = re.search(r"```python\n(.*?)\n```", part, re.S)
    assert match, f"no python block under '### {heading}'"
    return match.group(1)


def shorten(code: str, replacements: dict[str, str]) -> str:
    for old, new in replacements.items():
        assert code.count(old) == 1, f"the quick start no longer holds {old!r} exactly once"
        code = code.replace(old, new)
    return code


def tiny_tokenizer(*args, **kwargs):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)} | {"<pad>": V - 3, "<eos>": V - 2, "<unk>": V - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")  # no pad: the README sets it


def tiny_model(*args, **kwargs):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True)  # fmt: skip
    return LlamaForCausalLM(config)


def tiny_dataset(*args, **kwargs):
    import random

    rng = random.Random(0)
    rows = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20))) for _ in range(40)]
    rows += ["", " w1 "]  # WikiText's empty and short lines, which the README's filter drops
    return datasets.Dataset.from_dict({"text": rows})


@pytest.fixture
def offline(monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", tiny_tokenizer)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", tiny_model)
    monkeypatch.setattr(datasets, "load_dataset", tiny_dataset)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def scalars(logdir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[int, float] = {}
    for events in logdir.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            out.update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def test_hugging_face_trainer_quickstart(offline):
    code = shorten(quickstart("Hugging Face Trainer (and TRL)"), {"max_steps=200": "max_steps=4", "logging_steps=10": "logging_steps=1"})
    namespace: dict = {"__name__": "__main__"}
    exec(compile(code, "README.md: Hugging Face quick start", "exec"), namespace)
    history = namespace["trainer"].state.log_history
    loss = {r["step"]: r["loss"] for r in history if "loss" in r}
    ours = {r["step"]: r for r in history if "headwatch/logits/target_nll" in r}
    assert sorted(ours) == [1, 2, 3, 4] and sorted(loss) == [1, 2, 3, 4]
    for step, record in ours.items():  # the Trainer's own loss of the step (its logging_steps=1 mean is that step's)
        assert record["headwatch/logits/target_nll"] == pytest.approx(loss[step], abs=1e-5)
        assert 0.0 <= record["headwatch/logits/entropy"] <= math.log(V)
        assert record["headwatch/grad/tied"] == 1.0  # SmolLM2's family, tied: the tied split is measured
    written = scalars(offline / "out", "train/headwatch/logits/entropy")  # the Trainer's own TensorBoard writer
    assert sorted(written) == [1, 2, 3, 4]
    assert written[4] == pytest.approx(ours[4]["headwatch/logits/entropy"], rel=1e-6)


def test_lightning_quickstart(offline):
    code = shorten(quickstart("PyTorch Lightning"), {"max_steps=200": "max_steps=4", "log_every_n_steps=10": "log_every_n_steps=1"})
    code = code.replace("L.Trainer(", "L.Trainer(enable_progress_bar=False, enable_model_summary=False, ", 1)
    exec(compile(code, "README.md: Lightning quick start", "exec"), {"__name__": "__main__"})
    logdir = offline / "lightning_logs"
    loss = scalars(logdir, "train_loss")
    nll = scalars(logdir, "headwatch/logits/target_nll")
    entropy = scalars(logdir, "headwatch/logits/entropy")
    assert sorted(nll) == sorted(loss) == [0, 1, 2, 3]
    for step in loss:  # the loss the LightningModule computed and logged on the same batch
        assert nll[step] == pytest.approx(loss[step], abs=1e-5)
        assert 0.0 <= entropy[step] <= math.log(V)
    assert scalars(logdir, "headwatch/grad/head_row_density")  # the gradient monitor ran too


def test_plain_loop_quickstart(offline, capsys):
    code = shorten(quickstart("Plain PyTorch loop"), {"step == 200": "step == 4", "log_every_n_steps=10": "log_every_n_steps=2"})
    namespace: dict = {"__name__": "__main__"}
    exec(compile(code, "README.md: plain-loop quick start", "exec"), namespace)
    values, loss = namespace["values"], namespace["loss"]  # the last step (3) logs: its values and its loss
    assert values["headwatch/logits/target_nll"] == pytest.approx(loss.item(), abs=1e-5)
    assert 0.0 <= values["headwatch/logits/entropy"] <= math.log(V)
    printed = capsys.readouterr().out
    assert re.search(r"^1 entropy \d\.\d{3} nats$", printed, re.M) and re.search(r"^3 entropy \d\.\d{3} nats$", printed, re.M)
    # the with block's end is the run's end event: the end-of-training summary, with the last step's figures
    hw = namespace["hw"]
    assert "headwatch: training ended at step 3" in printed and hw.summary.text in printed
    assert hw.summary.figures["target_nll"] == values["headwatch/logits/target_nll"]
    assert hw.summary.figures["entropy_last"] == values["headwatch/logits/entropy"]
    written = scalars(offline / "runs" / "loop", "headwatch/logits/entropy")  # closed writer: on disk
    assert sorted(written) == [1, 3]
    assert written[3] == pytest.approx(values["headwatch/logits/entropy"], rel=1e-6)


def test_headline_names_of_the_readme_are_declared_metrics():
    """Every name in README.md's "What is measured" table is a metric headwatch declares (and so publishes:
    tests/core/test_core.py checks every declaration is emitted); a renamed metric fails here."""
    from headwatch import names

    text = README.read_text(encoding="utf-8")
    table = text.split("\n## What is measured\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and not line.startswith("| group")]
    found = [name for row in rows for name in re.findall(r"`([a-z_/<>]+)`", row[1])]
    assert len(found) >= 15, found
    for name in found:
        concrete = name.replace("<matrix>", "head").replace("<rule>", "entropy_floor")
        assert names.declaration(f"headwatch/{concrete}") is not None, name
    assert names.declaration("headwatch/logits/no_such_metric") is None  # the check can fail
