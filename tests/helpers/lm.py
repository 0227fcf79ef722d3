"""A tiny causal LM with a `tie_weights` switch, data for it, one watched plain-loop step, and the batch reader."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class TinyCausalLM(pl.LightningModule):
    """Embedding -> one causal-mixing MLP layer -> lm_head; Hugging Face batch conventions.

    ``forward(input_ids)`` returns logits ``(B, T, V)``; the loss shifts labels inside
    (logits at ``t`` predict ``labels[t + 1]``), as Hugging Face causal LMs do.
    """

    def __init__(self, vocab_size: int = 64, d_model: int = 16, tie_weights: bool = False, lr: float = 1e-2):
        super().__init__()
        self.save_hyperparameters()
        self.embed_tokens = nn.Embedding(vocab_size, d_model)
        self.mix = nn.Linear(d_model, d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.embed_tokens.weight
        self.sanitize_logits = False
        self.clamp_labels = False  # for a vocabulary-mismatch test: labels may exceed the head's size
        self.records: list[tuple[str, int, torch.Tensor, dict]] = []  # (stage, global_step, logits, batch)
        self.keep_logits = False

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # (B, T, d)
        # causal mean over the prefix, so position t sees tokens <= t
        counts = torch.arange(1, h.shape[1] + 1, device=h.device).view(1, -1, 1)
        h = h + torch.tanh(self.mix(h.cumsum(1) / counts))
        return self.lm_head(h)  # (B, T, V)

    def _loss(self, batch: dict, stage: str) -> torch.Tensor:
        logits = self(batch["input_ids"])
        if self.keep_logits:
            self.records.append((stage, self.global_step, logits.detach().clone(), {k: v.clone() for k, v in batch.items()}))
        if self.sanitize_logits:  # for a NaN-logits test: keep training finite whatever the head emits
            logits = torch.nan_to_num(logits, nan=0.0, posinf=0.0)
        labels = batch["labels"]
        if self.clamp_labels:
            labels = torch.where(labels == -100, labels, labels.clamp(max=logits.shape[-1] - 1))
        if (labels[:, 1:] == -100).all():
            return logits.sum() * 0.0  # an all-masked batch has no loss; keep the graph
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch, "train")
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch, "val"))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class TokenDataset(Dataset):
    """Deterministic random token sequences; some positions padded (attention 0, label -100)."""

    def __init__(self, n: int = 32, seq_len: int = 12, vocab_size: int = 64, seed: int = 0, pad: bool = True):
        g = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(0, vocab_size, (n, seq_len), generator=g)
        self.attention_mask = torch.ones(n, seq_len, dtype=torch.long)
        if pad:
            lengths = torch.randint(seq_len // 2, seq_len + 1, (n,), generator=g)
            self.attention_mask = (torch.arange(seq_len).view(1, -1) < lengths.view(-1, 1)).long()
        self.labels = self.input_ids.masked_fill(self.attention_mask == 0, -100)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.input_ids[i], "attention_mask": self.attention_mask[i], "labels": self.labels[i]}


def loader(n: int = 32, batch_size: int = 8, **kw) -> DataLoader:
    return DataLoader(TokenDataset(n=n, **kw), batch_size=batch_size, shuffle=False)


class IdsDataset(Dataset):
    """Fixed token sequences (B, T): labels equal the inputs, no padding."""

    def __init__(self, input_ids: torch.Tensor):
        self.input_ids = input_ids

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.input_ids[i], "labels": self.input_ids[i]}


def ids_loader(input_ids: torch.Tensor, batch_size: int) -> DataLoader:
    return DataLoader(IdsDataset(input_ids), batch_size=batch_size, shuffle=False)


def watched_step(hw, model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor, step: int) -> dict[str, float]:
    """One plain-loop training step of a causal LM returning ``(B, T, V)`` logits, watched through the plain-loop
    door (``hw``: a :class:`headwatch.Headwatch`): next-token cross-entropy, backward, the optimizer step; returns
    ``hw.step_end()``."""
    hw.step_start({"input_ids": ids, "labels": ids}, step)
    logits = model(ids)
    F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    hw.before_optimizer_step()
    optimizer.step()
    hw.after_optimizer_step()
    optimizer.zero_grad()
    return hw.step_end()


def positions(batch, alignment: str = "causal", **fmt) -> tuple:
    """``(mask, targets)`` of ``batch`` as the monitors read them for the model kind ``alignment`` (``"causal"``,
    ``"seq2seq"``, ``"aligned"``): the one batch reader, ``BatchFormat(**fmt).for_alignment(alignment)``."""
    from headwatch.model.batch import BatchFormat

    view = BatchFormat(**fmt).for_alignment(alignment).read(batch)
    return view.mask, view.targets
