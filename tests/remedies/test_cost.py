"""headwatch cost: exact integers against hand-computed values, the table of docs/remedies.md against the tool."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from headwatch import HeadwatchError
from headwatch.remedies.cost import (
    KNOWN_CONFIGS,
    MAX_CONFIG_BYTES,
    count_parameters,
    main,
    readme_table,
    shape_from_config,
    untie_cost,
)
from tests.helpers.paths import ROOT

REMEDIES = ROOT / "docs" / "remedies.md"


def test_llama3_8b_and_gpt2_small_by_hand():
    llama = untie_cost(128256, 4096)
    assert llama.params_added == 525_336_576  # 128256 * 4096
    assert llama.weight_bytes(2) == 1_050_673_152 and llama.weight_bytes(4) == 2_101_346_304
    assert llama.weight_bytes(16) == 8_405_385_216  # bf16 + fp32 master + AdamW m, v: 2 + 2 + 4 + 8 bytes
    assert untie_cost(50257, 768).params_added == 38_597_376  # 50257 * 768


def test_fsdp_per_gpu_rounds_up():
    cost = untie_cost(50257, 768, world_size=5)  # 38,597,376 / 5 = 7,719,475.2 parameters
    assert cost.per_gpu_bytes(2) == 7_719_476 * 2 and cost.per_gpu_bytes(16) == 7_719_476 * 16


def test_shares_for_a_tied_and_an_untied_count():
    untied = untie_cost(128256, 4096, params=8_030_261_248, tied=False)
    assert (untied.params_tied, untied.params_untied) == (7_504_924_672, 8_030_261_248)
    assert untied.share_of_untied == pytest.approx(525_336_576 / 8_030_261_248)
    tied = untie_cost(50257, 768, params=124_439_808, tied=True)
    assert tied.params_untied == 124_439_808 + 38_597_376


def test_parameter_counts_from_configs_match_the_published_ones():
    """Counted on the meta device; the published totals (model cards, safetensors metadata) by hand."""
    pytest.importorskip("transformers")
    assert count_parameters(KNOWN_CONFIGS["Llama 3 8B"]) == 8_030_261_248
    assert count_parameters(KNOWN_CONFIGS["GPT-2 small"]) == 124_439_808
    assert count_parameters(KNOWN_CONFIGS["Llama 3.2 1B"]) == 1_235_814_400


def test_cli_with_a_config_file(tmp_path, capsys):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(KNOWN_CONFIGS["Llama 3 8B"]))
    assert main(["--config", str(path), "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "525,336,576" in out and "1,050,673,152 bytes" in out and "8,030,261,248  (ships untied)" in out
    assert "6.54%" in out  # 525,336,576 / 8,030,261,248
    # FSDP over 8, 16 bytes/param: 525,336,576 / 8 * 16 = 1,050,673,152
    assert re.search(r"bf16 \+ fp32 master.*\|  1,050,673,152", out)


def test_multimodal_text_config():
    config = {"model_type": "x", "text_config": {"vocab_size": 262208, "hidden_size": 2560}, "vision_config": {"hidden_size": 1152}}
    assert shape_from_config(config) == (262208, 2560, True)


def test_errors(tmp_path, capsys):
    with pytest.raises(HeadwatchError, match=r"`vocab_size` must be an int in \[1, 2147483647\], got 0"):
        untie_cost(0, 8)
    with pytest.raises(HeadwatchError, match="`tied` must be True or False"):
        untie_cost(8, 8, params=1000)
    with pytest.raises(HeadwatchError, match="too small"):
        untie_cost(100, 100, params=10, tied=True)
    with pytest.raises(SystemExit):
        main(["--vocab-size", "10"])
    assert "give --config PATH, or --vocab-size V and --d-model D" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--config", str(tmp_path / "missing.json")])
    assert "cannot read a JSON config" in capsys.readouterr().err


def test_python_dash_m():
    out = subprocess.run(
        [sys.executable, "-m", "headwatch.remedies.cost", "--vocab-size", "50257", "--d-model", "768"],
        capture_output=True, text=True, check=True,
    ).stdout
    assert "38,597,376" in out


def test_remedies_page_table_is_the_tools_output():
    pytest.importorskip("transformers")
    text = REMEDIES.read_text(encoding="utf-8")
    match = re.search(r"<!-- headwatch-cost-table:start -->\n(.*?)\n<!-- headwatch-cost-table:end -->", text, re.S)
    assert match, "docs/remedies.md has no headwatch-cost-table block"
    assert match.group(1) == readme_table(), "regenerate it: python -m headwatch.remedies.cost --readme-table"


@pytest.mark.parametrize(
    "text, message",
    [
        ("[1, 2]", "must be a JSON object .*got a list"),  # was: AttributeError traceback
        ('{"text_config": [1], "vocab_size": 5, "hidden_size": 4}', "`text_config` must be a JSON object, got a list"),
        ('{"vocab_size": 5, "hidden_size": 4, "tie_word_embeddings": "false"}', "must be true or false, got 'false'"),
    ],
)
def test_a_config_that_is_not_a_config_object_is_a_clear_error(tmp_path, capsys, text, message):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(HeadwatchError, match=message):
        shape_from_config(json.loads(text))
    with pytest.raises(SystemExit) as exit_info:  # the CLI: a usage error (exit 2), not a traceback
        main(["--config", str(path)])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def refused(capsys, argv: list[str]) -> str:
    """The one line ``headwatch cost`` prints when it refuses ``argv`` (exit status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert len(err.splitlines()) == 1 and err.startswith("headwatch cost: error: "), err
    return err


def test_a_fifo_or_a_folder_is_refused_with_one_line_without_reading(tmp_path, capsys):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # reading it would block forever: refused before any open
    assert "not a regular file" in refused(capsys, ["--config", str(fifo)])
    folder = tmp_path / "model"
    (folder / "config.json").mkdir(parents=True)
    assert "not a regular file" in refused(capsys, ["--config", str(folder)])
    assert "cannot read a JSON config" in refused(capsys, ["--config", str(tmp_path)])  # no config.json in it


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--vocab-size", "-5", "--d-model", "8"], "`vocab_size` must be an int in [1, 2147483647], got -5"),
        (["--vocab-size", str(10**30), "--d-model", "8"], "`vocab_size` must be an int in [1, 2147483647]"),
        (["--vocab-size", "8", "--d-model", "0"], "`d_model` must be an int in [1, 1048576], got 0"),
        (["--vocab-size", "8", "--d-model", str(2**40)], "`d_model` must be an int in [1, 1048576]"),
        (["--vocab-size", "8", "--d-model", "8", "--world-size", "0"], "`world_size` must be an int in [1, 1048576]"),
        (["--vocab-size", "8", "--d-model", "8", "--world-size", str(10**12)], "`world_size`"),
        (["--vocab-size", "8", "--d-model", "8", "--params", "-1", "--tied"], "`params` must be None or an int in"),
        (["--vocab-size", "8", "--d-model", "8", "--params", str(10**20), "--tied"], "`params` must be None or an int in"),
    ],
)
def test_absurd_sizes_are_refused_with_one_line(capsys, argv, words):
    assert words in refused(capsys, argv)


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"model_type": "llama", "vocab_size": 1000000000000, "hidden_size": 64}', "`vocab_size` must be an int in"),
        ('{"model_type": "llama", "vocab_size": -3, "hidden_size": 64}', "`vocab_size` must be an int in [1, 2147483647], got -3"),
        ('{"model_type": "llama", "vocab_size": 64, "hidden_size": 99999999999}', "`d_model` must be an int in"),
        ('{"vocab_size": ' + "9" * 5000 + ', "hidden_size": 4}', "cannot read a JSON config"),
        ("[" * 100_000, "cannot read a JSON config: nested too deep"),
        (b"\xff\xfe{}", "cannot read a JSON config"),
    ],
)
def test_absurd_configs_are_refused_with_one_line_before_any_model_is_built(tmp_path, capsys, text, words):
    path = tmp_path / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    start = time.monotonic()
    assert words in refused(capsys, ["--config", str(path)])
    assert time.monotonic() - start < 5


def test_a_config_larger_than_any_config_is_refused(tmp_path, capsys):
    path = tmp_path / "config.json"
    with open(path, "wb") as f:
        f.truncate(MAX_CONFIG_BYTES + 1)  # sparse: no disk used
    assert "more than a config.json holds" in refused(capsys, ["--config", str(path)])
