"""Rare head rows mixed into other rare rows by a known amount: does the drift-corrected rate flag them?

usage: python bench/planted_duplicates.py RUN/checkpoints/last.ckpt (examples/train_tiny_lm.py --checkpoint, tied)
"""
import torch, sys
from headwatch.functional.frequency import frequency_buckets, rare_tokens
from headwatch.functional.drift import pairable_rows
from headwatch.functional.drift_pairs import corrected_collision
ck = torch.load(sys.argv[1], map_location="cpu", weights_only=False)
w0 = ck["state_dict"]["lm_head.weight"].clone()
counts = next(v["counts"] for k, v in ck["callbacks"].items() if "TokenFrequency" in k)
valid = torch.ones(w0.shape[0], dtype=torch.bool)
rare = rare_tokens(counts, valid)
ids = rare.nonzero().flatten()
g = torch.Generator().manual_seed(0)
perm = ids[torch.randperm(ids.numel(), generator=g)]
a, b = perm[:100], perm[100:200]
for mix in (0.5, 0.75, 0.9):
    w = w0.clone()
    w[b] = mix * w0[a] + (1 - mix) * w0[b]  # row b mixed into row a
    p = pairable_rows(w, valid, counts > 0)
    res, _ = corrected_collision(w, ids, p.mask)
    flagged = res.cosine >= 0.9
    planted = torch.isin(res.queries, b)
    others = ~torch.isin(res.queries, torch.cat([a, b]))
    raw_others = (res.raw_cosine[others] >= 0.9).double().mean().item()
    print(f"mix {mix}: planted flagged {flagged[planted].double().mean():.3f}, other rare flagged {flagged[others].double().mean():.4f} (raw cosine: {raw_others:.3f})")
