"""Run by tests/distributed/test_ddp_skipped_backward.py: the plain loop on 2 CPU processes (gloo), every monitor logging every
step; at step 2 rank 1 catches an exception raised before its backward and skips it (no gradients on that rank
for that step), then goes on. Each rank dumps the values ``step_end`` returned per step.

usage: python tests/workers/ddp_skipped_backward.py RANK PORT OUT_DIR
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from headwatch import Headwatch  # noqa: E402
from tests.helpers import TinyCausalLM  # noqa: E402

V, STEPS, SKIP_AT = 64, 4, 2


def main() -> None:
    rank, port, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)  # the same model on both ranks: the reduced values must be equal
    model = TinyCausalLM(vocab_size=V, d_model=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    warnings.simplefilter("ignore")
    hw = Headwatch(model, log_every_n_steps=1, figure_every_n_steps=0)
    published: dict[int, dict[str, float]] = {}
    g = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        ids = torch.randint(0, V, (4, 8), generator=g)
        hw.step_start({"input_ids": ids, "labels": ids}, step)
        try:
            logits = model(ids)
            if step == SKIP_AT and rank == 1:
                raise RuntimeError("a bad batch on rank 1")
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
            loss.backward()
        except RuntimeError:
            pass  # the user's loop skips this rank's backward and goes on
        hw.before_optimizer_step()
        optimizer.step()
        hw.after_optimizer_step()
        optimizer.zero_grad()
        published[step] = {k: (v if math.isfinite(v) else str(v)) for k, v in hw.step_end().items()}
    (out / f"rank{rank}.json").write_text(json.dumps(published))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
