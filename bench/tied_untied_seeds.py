"""Tied vs untied over seeds, from the example's checkpoints.

Each run is ``examples/train_tiny_lm.py --seed S [--no-tie-weights] --checkpoint``. For each, on
its own held-out validation files (the same random sample of files the run validated on, drawn
with its seed, tokenized with its saved tokenizer), from the final weights:

- ``nll``: mean target NLL (nats), ``entropy``: mean prediction entropy (nats), and
  ``nll - entropy`` (a loss-independent calibration signal: 0 when the model's own
  uncertainty matches the loss it pays; positive: over-confident on average);
- ``ece``: expected calibration error of the top-1 prediction (15 equal-width bins),
  ``overconfidence``: mean max probability minus accuracy, and both for rare targets
  (:mod:`headwatch.functional.calibration`);
- ``nll_rare``, ``accuracy``, ``accuracy_rare``;
- the collision headline (drift removed) and the raw-cosine drift rate of the head (and the
  untied embedding), from the weights and the run's token counts.

Per metric and group: mean, sample sd, [min, max]; untied - tied with the 95% Welch t-interval
of ``headwatch report --group`` (:func:`headwatch.report.compare.welch_interval`), and the
paired per-seed differences (same seed = same held-out files and tokenizer corpus).

usage: PYTHONPATH=src python bench/tied_untied_seeds.py RUNS_DIR [--out summary.json]
  (RUNS_DIR holds tied_s<S>/version_0 and untied_s<S>/version_0)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from tiny_lm import TinyLM, TokenWindows, encode_documents, read_corpus, stdlib_source_files  # noqa: E402
from train_tiny_lm import split_documents  # noqa: E402

from headwatch.functional.calibration import calibration_compute, calibration_update, empty_sums  # noqa: E402
from headwatch.functional.drift import pairable_rows  # noqa: E402
from headwatch.functional.drift_pairs import corrected_collision  # noqa: E402
from headwatch.functional.frequency import BUCKETS, frequency_snapshot  # noqa: E402
from headwatch.functional.logits import logit_statistics  # noqa: E402
from headwatch.report.compare import group_stats, welch_interval  # noqa: E402

METRICS = (
    "nll", "entropy", "nll_minus_entropy", "ece", "overconfidence", "ece_rare", "overconfidence_rare", "nll_rare",
    "accuracy", "accuracy_rare", "collision_head", "drift_raw_rate_head", "collision_embedding", "drift_raw_rate_embedding",
)  # fmt: skip


@torch.no_grad()
def evaluate(run: Path, seed: int, max_corpus_mb: float = 3.0, val_fraction: float = 0.05) -> dict[str, float]:
    from tokenizers import Tokenizer

    ck = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    model = TinyLM(**ck["hyper_parameters"])
    model.load_state_dict(ck["state_dict"])
    model.eval()
    tok = Tokenizer.from_file(str(run / "tokenizer.json"))
    docs = read_corpus(stdlib_source_files(), max_bytes=int(max_corpus_mb * 2**20))
    _, val_docs = split_documents(docs, val_fraction, seed)
    windows = TokenWindows(encode_documents(tok, val_docs), model.config.block_size).windows  # (N, T)
    counts = next(v["counts"] for k, v in ck["callbacks"].items() if "TokenFrequency" in k).long()
    V = model.config.vocab_size
    counts = torch.nn.functional.pad(counts, (0, V - counts.numel()))
    snap = frequency_snapshot(counts, torch.arange(V) < tok.get_vocab_size())
    sums, entropy_sum = empty_sums(len(BUCKETS)), 0.0
    for s in range(0, windows.shape[0], 8):
        ids = windows[s : s + 8]
        logits = model(ids).logits[:, :-1]  # (B, T-1, V)
        targets = ids[:, 1:]
        stats = logit_statistics(logits, targets=targets)
        part = calibration_update(stats, targets, snap.bucket, len(BUCKETS), snap.rare)
        sums = type(sums)(*(a + b for a, b in zip(sums, part)))
        entropy_sum += stats.entropy[stats.valid].double().sum().item()
    out = {k: float(v) for k, v in calibration_compute(sums, BUCKETS).items()}
    out["entropy"] = entropy_sum / out["positions"]
    out["nll_minus_entropy"] = out["nll"] - out["entropy"]
    mats = {"head": model.lm_head.weight}
    if model.lm_head.weight is not model.embed_tokens.weight:
        mats["embedding"] = model.embed_tokens.weight
    for name, w in mats.items():
        p = pairable_rows(w, snap.valid, snap.counts > 0)
        res, _ = corrected_collision(w, snap.rare.nonzero().flatten(), p.mask)
        out[f"collision_{name}"], out[f"drift_raw_rate_{name}"] = res.rate.item(), res.raw_rate.item()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    values: dict[str, dict[int, dict[str, float]]] = {"tied": {}, "untied": {}}
    for run in sorted(args.runs.glob("*_s*/version_0")):
        m = re.fullmatch(r"(tied|untied)_s(\d+)", run.parent.name)
        if m and (run / "checkpoints" / "last.ckpt").exists():
            values[m[1]][int(m[2])] = evaluate(run, int(m[2]))
            print(run.parent.name, {k: round(v, 4) for k, v in values[m[1]][int(m[2])].items() if k in METRICS}, flush=True)
    rows = {}
    for metric in METRICS:
        t = group_stats({str(s): v[metric] for s, v in values["tied"].items() if metric in v})
        u = group_stats({str(s): v[metric] for s, v in values["untied"].items() if metric in v})
        d = welch_interval(t, u)
        paired = [values["untied"][s][metric] - values["tied"][s][metric] for s in values["tied"]
                  if s in values["untied"] and metric in values["tied"][s] and metric in values["untied"][s]]  # fmt: skip
        rows[metric] = {"tied": t.__dict__, "untied": u.__dict__, "welch": d.__dict__ if d else None, "paired": paired}
        if t.n:
            cell = lambda g: f"{g.mean:.4f} sd {g.std or 0:.4f} [{g.min:.4f}, {g.max:.4f}] n={g.n}" if g.n else "-"  # noqa: E731
            ci = f"{d.diff:+.4f} [{d.low:+.4f}, {d.high:+.4f}]{' *' if d.excludes_zero else ''}" if d and d.low is not None else "-"
            print(f"{metric:28s} tied {cell(t)} | untied {cell(u)} | untied - tied {ci} | paired {[round(x, 4) for x in paired]}")
    if args.out:
        args.out.write_text(json.dumps({"runs": values, "comparison": rows}, indent=1))
    print(markdown(rows))


def markdown(rows: dict) -> str:
    """The comparison as a README table: mean, sd, [min, max] per group; the Welch interval; per-seed differences."""
    lines = ["| metric | tied: mean (sd) [min, max] | untied: mean (sd) [min, max] | untied - tied, 95% Welch CI | per seed |",
             "|---|---|---|---|---|"]  # fmt: skip
    for metric, r in rows.items():
        t, u, d = r["tied"], r["untied"], r["welch"]
        if not t["n"] or not u["n"]:
            continue
        cell = lambda g: f"{g['mean']:.4f} ({g['std'] or 0:.4f}) [{g['min']:.4f}, {g['max']:.4f}]"  # noqa: E731
        ci = f"{d['diff']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]{' **excludes 0**' if d['excludes_zero'] else ''}" if d and d["low"] is not None else "-"
        lines.append(f"| `{metric}` | {cell(t)} | {cell(u)} | {ci} | {', '.join(f'{x:+.4f}' for x in r['paired'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
