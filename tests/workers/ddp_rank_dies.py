"""Run by tests/distributed/test_ddp_rank_dies.py: the plain loop on 2 CPU processes (gloo, process-group timeout
``TIMEOUT_S``), no DDP model (headwatch's reductions are the only collectives), logging every step to a
``SummaryWriter`` on rank 0. Rank 1 dies hard at step ``DIE_AT``: ``exit`` (``os._exit(1)`` between two steps,
before that step's forward) or ``kill`` (SIGKILL to itself inside ``step_end``, right before the step's first
collective), or, for comparison, ``stop`` (SIGSTOP there: a rank that hangs, its sockets open). Rank 0 appends each step's returned values to ``rank0.jsonl`` and, when its loop ends, writes
``rank0_end.json`` (the exception it got, if any) and exits (code 3 after an exception).

usage: python tests/workers/ddp_rank_dies.py RANK PORT OUT_DIR MODE (or ``run(rank, port, out, mode)`` in a forked process)
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter

from headwatch import Headwatch
from tests.helpers import watched_step


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.lm_head = torch.nn.Embedding(V, 16), torch.nn.Linear(16, V, bias=False)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.embed(ids))

V, STEPS, DIE_AT, TIMEOUT_S = 64, 8, 4, 10  # the stop mode waits it out: short, yet far above a step


def run(rank: int, port: str, out: Path, mode: str) -> None:
    """One rank (the test forks it, with everything imported already; or ``main`` from the command line)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))  # fmt: skip
    torch.manual_seed(0)
    model = Tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    warnings.simplefilter("ignore")
    writer = SummaryWriter(str(out / "tb")) if rank == 0 else None
    hw = Headwatch(model, monitors=["logits", "tokens"], writer=writer, log_every_n_steps=1, figure_every_n_steps=0)
    if rank == 1 and mode in ("kill", "stop"):
        all_reduce = dist.all_reduce

        def dying_all_reduce(*args, **kwargs):
            if hw.step_index == DIE_AT:
                os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
            return all_reduce(*args, **kwargs)

        dist.all_reduce = dying_all_reduce
    g = torch.Generator().manual_seed(rank)
    error, started = None, time.monotonic()
    try:
        for step in range(STEPS):
            if rank == 1 and mode == "exit" and step == DIE_AT:
                os._exit(1)
            ids = torch.randint(0, V, (4, 8), generator=g)
            values = watched_step(hw, model, optimizer, ids, step)
            if rank == 0:
                with open(out / "rank0.jsonl", "a") as f:
                    f.write(json.dumps({"step": step, "values": values, "t": time.monotonic() - started}) + "\n")
    except Exception as err:  # noqa: BLE001 - reported to the test
        error = f"{type(err).__name__}: {err}"
    if rank == 0:
        (out / "rank0_end.json").write_text(json.dumps({"error": error, "t": time.monotonic() - started}))
    sys.stdout.flush()
    os._exit(3 if error else 0)  # no destroy_process_group: the peer is gone


def main() -> None:
    run(int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4])


if __name__ == "__main__":
    main()
