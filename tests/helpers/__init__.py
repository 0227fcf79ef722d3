"""What the tests share, one module per theme; a test file imports from here, never from another test file.

- :mod:`tests.helpers.lm`: the tiny causal LM with a ``tie_weights`` switch, its data, a watched plain-loop step,
  the batch reader (``positions``);
- :mod:`tests.helpers.distributed`: gloo workers, a clean shutdown, free ports, W simulated processes in one;
- :mod:`tests.helpers.paths`: ``ROOT``, the repository;
- the others by what they serve (``hf``: the Hugging Face door's tiny Llama and Trainer arguments; ``lightning_runs``:
  a Trainer and a logger that keeps every step; ``events``: TensorBoard event files read back; ``references``:
  float64 references; ...).

The names of ``lm``, ``distributed`` and ``paths`` are also importable from here (``from tests.helpers import
TinyCausalLM, loader``), as most tests do.
"""

from __future__ import annotations

from tests.helpers.distributed import run_gloo_workers, shutdown_distributed
from tests.helpers.lm import IdsDataset, TinyCausalLM, TokenDataset, ids_loader, loader, positions, watched_step
from tests.helpers.paths import ROOT

__all__ = [
    "ROOT",
    "IdsDataset",
    "TinyCausalLM",
    "TokenDataset",
    "ids_loader",
    "loader",
    "positions",
    "run_gloo_workers",
    "shutdown_distributed",
    "watched_step",
]
