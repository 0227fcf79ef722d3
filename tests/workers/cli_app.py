"""A small LightningCLI script (model + data) used to test the presets in callbacks/."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402

from tests.helpers import TinyCausalLM, loader  # noqa: E402


class TokenData(pl.LightningDataModule):
    def __init__(self, n: int = 32, batch_size: int = 8):
        super().__init__()
        self.n, self.batch_size = n, batch_size

    def train_dataloader(self):
        return loader(n=self.n, batch_size=self.batch_size)

    def val_dataloader(self):
        return loader(n=16, batch_size=self.batch_size, seed=1)


def main(args: list[str] | None = None) -> LightningCLI:
    return LightningCLI(TinyCausalLM, TokenData, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
