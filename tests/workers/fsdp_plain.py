"""Run by tests/distributed/test_fsdp.py: the plain-loop front door ``headwatch.Headwatch`` on 2 CPU processes under FSDP2
``fully_shard`` applied AFTER ``Headwatch`` attached (fully_shard swaps in DTensor Parameters), tied and untied;
rank 0 also trains a one-process twin on the same global batches and writes both runs' values.

usage: python tests/workers/fsdp_plain.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

V, D, STEPS = 63, 16, 3
MONITORS = ["tokens", "logits", "gradients", "collision"]


class LM(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(V, D)
        self.mix = nn.Linear(D, D)
        self.lm_head = nn.Linear(D, V, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x)  # (B, T, d)
        return self.lm_head(h + torch.tanh(self.mix(h)))  # (B, T, V)


def train(model, hw, data, rank: int, world: int) -> list[dict[str, float]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    for step, batch in enumerate(data):
        x = batch[rank::world]  # this process's half of the global batch
        hw.step_start({"input_ids": x, "labels": x}, step)
        logits = model(x)
        F.cross_entropy(logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1)).backward()
        hw.before_optimizer_step()
        opt.step()
        hw.after_optimizer_step()
        opt.zero_grad()
        out.append(hw.step_end())
    return out


def work(rank: int, out_dir: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from torch.distributed.fsdp import fully_shard

    from headwatch import Headwatch
    from headwatch.core import NoReducer

    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, V, (8, 10), generator=g) for _ in range(STEPS)]
    result = {}
    for tied in (True, False):
        torch.manual_seed(0)
        model = LM(tied)
        hw = Headwatch(model, monitors=MONITORS, log_every_n_steps=1)
        fully_shard(model.mix)
        fully_shard(model)  # after Headwatch: the Parameters are replaced by DTensors
        sharded = train(model, hw, data, rank, 2)
        if rank == 0:
            torch.manual_seed(0)
            twin = LM(tied)
            single = train(twin, Headwatch(twin, monitors=MONITORS, log_every_n_steps=1, reducer=NoReducer()), data, 0, 1)
            result["tied" if tied else "untied"] = {"sharded": sharded, "single": single}
        hw.close()
    if rank == 0:
        Path(out_dir, "plain.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(work, args=(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "29537"), nprocs=2)
