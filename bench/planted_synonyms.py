"""True synonyms planted in the training text, tied and untied.

For ``--pairs`` tokens A drawn from three frequency bands of the training stream, a fresh
token A' (a new id) replaces A in half of its occurrences (a seeded coin per occurrence, in
the training and the validation stream). A and A' then have the same contexts: a model that
learns them should put their rows next to each other, and nothing else should collide.

The model is the example's (``examples/tiny_lm.py``), trained with ``TokenFrequency`` and
``SynonymCollisionMonitor(synonym_groups=[[A, A'], ...])`` attached. At the end, on the final
weights, per matrix (head; embedding when untied):

- partner rank of each planted pair, both directions, drift removed (``partner_ranks`` on
  the corrected rows) and raw, median per band;
- flagged planted pairs: corrected ``cos(A, A') >= tau``;
- false collisions: rare tokens outside every group whose nearest pairable row has corrected
  cosine ``>= tau`` (and raw cosine, the drift statistic);

and the logged median partner rank over training (``collision/synonym_partner_rank_<m>``).

usage: OMP_NUM_THREADS=1 PYTHONPATH=src python bench/planted_synonyms.py --no-tie-weights --out out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from tiny_lm import END_OF_TEXT, TinyLM, TinyLMConfig, encode_documents, read_corpus, stdlib_source_files, train_tokenizer  # noqa: E402
from train_tiny_lm import HeldOutFilesDataModule, split_documents  # noqa: E402

from headwatch import SynonymCollisionMonitor, TokenFrequency  # noqa: E402
from headwatch.functional.drift import pairable_rows  # noqa: E402
from headwatch.functional.drift_pairs import corrected_collision, partner_ranks  # noqa: E402

BANDS = {"frequent": (10, 60), "middle": (300, 900), "rare": None}  # count-rank ranges; rare: from the rare set


def pick_tokens(counts: torch.Tensor, per_band: int, exclude: set[int], gen: torch.Generator) -> dict[str, list[int]]:
    """``per_band`` token ids per band, by count rank among the seen tokens (rare: count 8-40, bottom half)."""
    order = torch.argsort(counts, descending=True, stable=True)
    seen = int((counts > 0).sum())
    picked = {}
    for band, ranks in BANDS.items():
        if ranks is None:  # enough occurrences for half of them to teach A'
            pool = order[seen // 2 : seen][(counts[order[seen // 2 : seen]] >= 8) & (counts[order[seen // 2 : seen]] <= 40)]
        else:
            pool = order[ranks[0] : ranks[1]]
        pool = torch.tensor([int(t) for t in pool if int(t) not in exclude])
        picked[band] = pool[torch.randperm(pool.numel(), generator=gen)[:per_band]].tolist()
    return picked


def plant(tokens: torch.Tensor, pairs: list[tuple[int, int]], gen: torch.Generator) -> torch.Tensor:
    """``tokens`` with each ``a`` replaced by ``a2`` at a seeded half of its positions."""
    out = tokens.clone()
    for a, a2 in pairs:
        where = (tokens == a).nonzero().flatten()
        coin = torch.rand(where.numel(), generator=gen) < 0.5
        out[where[coin]] = a2
    return out


def final_numbers(w: torch.Tensor, counts: torch.Tensor, valid: torch.Tensor, rare: torch.Tensor, bands, tau: float) -> dict:
    p = pairable_rows(w, valid, counts > 0)
    grouped = torch.tensor([t for pairs in bands.values() for pair in pairs for t in pair])
    others = (rare & p.mask).clone()
    others[grouped] = False
    res, corr = corrected_collision(w, others.nonzero().flatten(), p.mask, tau)
    out = {
        "false_collision_rate": res.rate.item(), "raw_rate_other_rare": res.raw_rate.item(),
        "other_rare_measured": res.queries.numel(), "removed_variance": res.removed_variance.item(),
        "drift_mean_cos": res.drift_mean_cos.item(), "bands": {},
    }  # fmt: skip
    for band, pairs in bands.items():
        a = torch.tensor([x for x, y in pairs] + [y for x, y in pairs])
        b = torch.tensor([y for x, y in pairs] + [x for x, y in pairs])
        keep = p.mask[a] & p.mask[b]
        a, b = a[keep], b[keep]
        if a.numel() == 0:
            out["bands"][band] = {"pairs_measured": 0}
            continue
        fixed = partner_ranks(corr.rows, a, b, p.mask).double()
        raw = partner_ranks(w, a, b, p.mask).double()
        cos = torch.nn.functional.cosine_similarity(corr.rows[a], corr.rows[b])
        out["bands"][band] = {
            "pairs_measured": int(keep.sum()), "median_rank": fixed.median().item(), "raw_median_rank": raw.median().item(),
            "rank_le_10": (fixed <= 10).double().mean().item(), "flagged_at_tau": (cos >= tau).double().mean().item(),
            "median_count_a": counts[a].double().median().item(),
        }  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tie-weights", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=250)
    ap.add_argument("--per-band", type=int, default=12)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--max-corpus-mb", type=float, default=2.0)
    ap.add_argument("--measure-every", type=int, default=50)
    ap.add_argument("--logdir", default="runs/planted_synonyms")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    pl.seed_everything(args.seed, verbose=False)
    docs = read_corpus(stdlib_source_files(), max_bytes=int(args.max_corpus_mb * 2**20))
    train_docs, val_docs = split_documents(docs, 0.05, args.seed)
    tok = train_tokenizer(train_docs, vocab_size=args.vocab_size)
    train, val = encode_documents(tok, train_docs), encode_documents(tok, val_docs)
    V0 = tok.get_vocab_size()
    gen = torch.Generator().manual_seed(args.seed)
    picked = pick_tokens(torch.bincount(train, minlength=V0), args.per_band, {int(tok.token_to_id(END_OF_TEXT))}, gen)
    fresh = iter(range(V0, V0 + sum(len(v) for v in picked.values())))
    bands = {band: [(a, next(fresh)) for a in ids] for band, ids in picked.items()}
    pairs = [pair for v in bands.values() for pair in v]
    train, val = plant(train, pairs, gen), plant(val, pairs, gen)
    V = V0 + len(pairs)
    dm = HeldOutFilesDataModule(train, val, block_size=128, batch_size=8)
    model = TinyLM(TinyLMConfig(vocab_size=V, tie_weights=args.tie_weights), max_steps=args.max_steps)
    freq = TokenFrequency(vocab_size=V)
    monitor = SynonymCollisionMonitor(every_n_steps=args.measure_every, synonym_groups=[list(p) for p in pairs], figures=False)
    name = "tied" if args.tie_weights else "untied"
    logger = pl.loggers.TensorBoardLogger(args.logdir, name=f"{name}_s{args.seed}", default_hp_metric=False)
    trainer = pl.Trainer(
        max_steps=args.max_steps, val_check_interval=args.measure_every, check_val_every_n_epoch=None, limit_val_batches=20,
        num_sanity_val_steps=0, log_every_n_steps=10, logger=logger, callbacks=[freq, monitor],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=dm)
    snap = freq.latest_snapshot()
    mats = {"head": model.lm_head.weight.detach()}
    if not args.tie_weights:
        mats["embedding"] = model.embed_tokens.weight.detach()
    result = {
        "tie_weights": args.tie_weights, "seed": args.seed, "max_steps": args.max_steps, "vocab": V, "pairs": bands,
        "rare_count": int(snap.rare.sum()), "rare_planted_a": sum(bool(snap.rare[a]) for a, _ in pairs),
        "rare_planted_a2": sum(bool(snap.rare[a2]) for _, a2 in pairs),
        "final": {m: final_numbers(w, snap.counts, snap.valid, snap.rare, bands, 0.9) for m, w in mats.items()},
        "logged": {
            k: v for k, v in ((k, float(v)) for k, v in trainer.callback_metrics.items()) if k.startswith("headwatch/collision")
        },
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["final"], indent=1))


if __name__ == "__main__":
    main()
