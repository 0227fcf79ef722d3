"""On a trained example: raw vs drift-corrected collision, and NLL/accuracy/ECE by frequency bucket.

usage: python bench/drift_by_bucket.py RUN/checkpoints/last.ckpt RUN/tokenizer.json
(a checkpoint of examples/train_tiny_lm.py --checkpoint with the default corpus, --seed 0).
"""
import sys, json
import torch
from tokenizers import Tokenizer
from headwatch.functional.frequency import BUCKETS, frequency_buckets, rare_tokens
from headwatch.functional.drift import pairable_rows, mean_resultant_length
from headwatch.functional.drift_pairs import corrected_collision, nn_cosine_by_bucket

ckpt_path, tok_path = sys.argv[1], sys.argv[2]
ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
sd = ck["state_dict"]
counts = next(v["counts"] for k, v in ck["callbacks"].items() if "TokenFrequency" in k)
tok = Tokenizer.from_file(tok_path)
n_tok = tok.get_vocab_size()
mats = {"head": sd["lm_head.weight"]}
if not torch.equal(sd["lm_head.weight"], sd["embed_tokens.weight"]):
    mats["embedding"] = sd["embed_tokens.weight"]
V = mats["head"].shape[0]
counts = counts[:V]
valid = torch.arange(V) < n_tok
seen = counts > 0
bucket = frequency_buckets(counts, valid)
rare = rare_tokens(counts, valid)
print("rows", V, "valid", int(valid.sum()), "seen", int((valid & seen).sum()), "rare", int(rare.sum()))
for name, w in mats.items():
    p = pairable_rows(w, valid, seen)
    q = rare.nonzero().flatten()
    res, corr = corrected_collision(w, q, p.mask)
    # the default k and k = 3
    res3, _ = corrected_collision(w, q, p.mask, k=3)
    sums, cnt = nn_cosine_by_bucket(corr.rows, p.mask.nonzero().flatten(), bucket, p.mask, len(BUCKETS))
    # old definition, as the current monitor: raw, pairs with every valid row (unseen included)
    from headwatch.functional.neighbors import nearest_neighbours
    old = (nearest_neighbours(w, q, valid).cosine >= 0.9).double().mean().item()
    print(json.dumps({
        "matrix": name, "k": corr.directions.shape[1],
        "rate_corrected": res.rate.item(), "rate_corrected_k3": res3.rate.item(),
        "raw_rate_pairable": res.raw_rate.item(), "raw_rate_old_definition": old,
        "drift_mean_cos": res.drift_mean_cos.item(), "removed_variance": res.removed_variance.item(),
        "excluded": {"padded": int(p.padded), "unseen": int(p.unseen), "zero": int(p.zero)},
        "corrected_nn_mean_by_bucket": {b: (sums[i] / cnt[i]).item() for i, b in enumerate(BUCKETS)},
    }))
    order = res.cosine.argsort(descending=True)[:8]
    for i in order.tolist():
        a, b = int(res.queries[i]), int(res.neighbour[i])
        print(f"   {res.cosine[i]:.3f}  {tok.decode([a])!r} ~ {tok.decode([b])!r}  (raw {res.raw_cosine[i]:.3f})")

# --- loss, accuracy, calibration by target bucket on the held-out files (seed 0)
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "examples"))
from tiny_lm import TinyLM, TinyLMConfig, read_corpus, stdlib_source_files, encode_documents, TokenWindows
from train_tiny_lm import split_documents
from headwatch.core.metrics_evidence import FrequencyCalibrationMetric
hp = ck["hyper_parameters"]
cfg = hp.get("config")
model = TinyLM(cfg) if cfg is not None else None
model.load_state_dict(sd)
model.eval()
docs = read_corpus(stdlib_source_files(), max_bytes=int(3.0 * 2**20))
_, val_docs = split_documents(docs, 0.05, 0)
windows = TokenWindows(encode_documents(tok, val_docs), 128).windows
metric = FrequencyCalibrationMetric()
with torch.no_grad():
    for i in range(0, len(windows), 32):
        x = windows[i : i + 32]
        logits = model(x).logits[:, :-1]
        metric.update(logits, x[:, 1:], bucket, rare)
out = {k: round(v.item(), 4) for k, v in metric.compute().items()}
print(json.dumps(out))
