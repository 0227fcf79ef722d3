"""Building blocks of the headwatch example job: a tiny GPT, its corpus, its tokenizer.

Importable on its own (tests add ``examples/`` to ``sys.path``) so that a test can
build the same model and data as ``train_tiny_lm.py`` without running the script:

- :class:`TinyLMConfig` and :class:`TinyLM`: a nanoGPT-style causal LM as a
  ``LightningModule`` with a Hugging Face style interface
  (``forward(input_ids, labels=None)``, internal label shift, ``ignore_index=-100``)
  and the submodule names headwatch looks for, ``embed_tokens`` and ``lm_head``,
  tied or untied;
- :func:`stdlib_source_files`, :func:`collect_text_files`, :func:`read_corpus`: a
  corpus that needs no download (the standard library's own ``*.py`` files) or the
  user's text files;
- :func:`train_tokenizer`, :func:`encode_documents`: a byte-level BPE tokenizer
  trained on that corpus with the ``tokenizers`` library (imported lazily);
- :class:`TokenWindows` and :class:`TokenDataModule`: fixed-length windows of the
  token stream, batches ``{"input_ids": (B, T), "labels": (B, T)}``.
"""

from __future__ import annotations

import math
import os
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

if TYPE_CHECKING:
    from tokenizers import Tokenizer

IGNORE_INDEX = -100
"""Label value that is not a prediction target (Hugging Face convention)."""

END_OF_TEXT = "<|endoftext|>"
"""Special token placed between documents in the token stream (GPT-2 convention)."""

_INSTALL_HINT = 'pip install -e ".[examples]"'


# --------------------------------------------------------------------------- model


@dataclass
class TinyLMConfig:
    """Shape of the model; the defaults are the example job's."""

    vocab_size: int = 8192  # rows of embed_tokens and of lm_head (tokenizer size, maybe padded)
    block_size: int = 128  # context length T: positions have learned embeddings up to this
    n_layer: int = 2  # transformer blocks
    n_head: int = 4  # attention heads; d_model must be a multiple of n_head
    d_model: int = 128  # hidden size
    dropout: float = 0.0  # tiny model, short run, plenty of data: no regularisation needed
    tie_weights: bool = True  # lm_head.weight is embed_tokens.weight (GPT-2, Llama 3.2 1B)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"`d_model` must be a multiple of `n_head`, got d_model={self.d_model}, n_head={self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1), got {self.dropout!r}")


class CausalLMOutput(NamedTuple):
    """What :meth:`TinyLM.forward` returns, named like Hugging Face's ``CausalLMOutput``."""

    loss: Tensor | None
    """Mean next-token cross-entropy in nats over positions whose label is not -100; None without labels."""
    logits: Tensor
    """(B, T, V) unnormalised scores; ``logits[:, t]`` predicts the token at position t + 1."""


class CausalSelfAttention(nn.Module):
    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv_proj = nn.Linear(config.d_model, 3 * config.d_model)
        self.out_proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.qkv_proj(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.out_proj(y)


class MLP(nn.Module):
    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(config.d_model, 4 * config.d_model)
        self.down_proj = nn.Linear(4 * config.d_model, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.down_proj(F.gelu(self.up_proj(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def lr_lambda(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Learning-rate multiplier: linear warmup to 1, then cosine decay to ``min_lr_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if max_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class TinyLM(pl.LightningModule):
    """A nanoGPT-style causal language model with a Hugging Face style interface.

    Token and learned position embeddings, ``n_layer`` pre-LayerNorm blocks (causal
    self-attention through ``F.scaled_dot_product_attention``, GELU MLP), a final
    LayerNorm and ``lm_head``. The logits come from calling the ``lm_head`` module,
    so a forward hook on it sees the full (B, T, V) logits.

    Args:
        config: model shape, including ``tie_weights`` (a dict of its fields is accepted).
        learning_rate: peak AdamW learning rate.
        weight_decay: AdamW weight decay, applied to matrices (dim >= 2) only.
        warmup_steps: optimizer steps of linear warmup.
        max_steps: length of the cosine schedule, in optimizer steps.
        min_lr_ratio: final learning rate as a fraction of the peak.

    Example:
        >>> model = TinyLM(TinyLMConfig(vocab_size=512, d_model=32, n_head=2))
        >>> ids = torch.randint(0, 512, (2, 16))
        >>> out = model(ids, labels=ids)
        >>> out.logits.shape, out.loss.ndim
        (torch.Size([2, 16, 512]), 0)
    """

    def __init__(
        self,
        config: TinyLMConfig | dict[str, Any] | None = None,
        *,
        learning_rate: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
        max_steps: int = 600,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        if config is None:
            config = TinyLMConfig()
        elif isinstance(config, dict):  # as saved in hparams: load_from_checkpoint passes a dict
            config = TinyLMConfig(**config)
        if learning_rate <= 0:
            raise ValueError(f"`learning_rate` must be > 0, got {learning_rate!r}")
        if warmup_steps < 0 or max_steps < 1:
            raise ValueError(
                f"`warmup_steps` must be >= 0 and `max_steps` >= 1, got {warmup_steps!r} and {max_steps!r}"
            )
        self.save_hyperparameters({"config": asdict(config)} | {
            "learning_rate": learning_rate,
            "weight_decay": weight_decay,
            "warmup_steps": warmup_steps,
            "max_steps": max_steps,
            "min_lr_ratio": min_lr_ratio,
        })
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.embed_positions = nn.Embedding(config.block_size, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith(("out_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        if config.tie_weights:
            # One matrix for both ends: named_parameters() lists it once, as embed_tokens.weight.
            self.lm_head.weight = self.embed_tokens.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def tie_weights(self) -> bool:
        """Whether ``lm_head.weight`` is ``embed_tokens.weight`` (checked, not just configured)."""
        return self.lm_head.weight is self.embed_tokens.weight

    def num_parameters(self) -> int:
        """Number of distinct parameters (a tied matrix counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> CausalLMOutput:
        """Logits for every position, and the next-token loss when ``labels`` are given.

        Args:
            input_ids: (B, T) token ids, ``T <= block_size``.
            labels: (B, T) target ids at the *same* positions as ``input_ids`` (usually
                a copy); the model shifts them, so ``logits[:, t]`` is scored against
                ``labels[:, t + 1]``. Positions labelled -100 are ignored.
        """
        B, T = input_ids.size()
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=input_ids.device)  # (T,)
        x = self.dropout(self.embed_tokens(input_ids) + self.embed_positions(pos))  # (B, T, C)
        for layer in self.layers:
            x = layer(x)  # (B, T, C)
        hidden = self.norm(x)  # (B, T, C)
        logits = self.lm_head(hidden)  # (B, T, V); a module call, so hooks on lm_head see it
        loss = None
        if labels is not None:
            # Shift the labels, not the logits: slicing logits[:, :-1] would copy (B, T, V).
            # The last position has no next token, so it gets ignore_index.
            targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # (B, T)
            loss = F.cross_entropy(
                logits.view(B * T, -1), targets.reshape(B * T), ignore_index=IGNORE_INDEX
            )  # mean over the B * (T - 1) (or fewer) scored positions
        return CausalLMOutput(loss=loss, logits=logits)

    collapse_from_step: int | None = None
    """From this step on, the training loss also rewards low entropy (``--induce-collapse``)."""
    collapse_weight: float = 1.0

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        out = self(batch["input_ids"], labels=batch["labels"])
        loss = out.loss
        self.log("train_loss", loss, prog_bar=True)
        if self.collapse_from_step is not None and self.global_step >= self.collapse_from_step:
            # Induced sharpness collapse, for demonstrating alerts: minimise the mean entropy of
            # the predictions, which drives them to a few "safe" tokens whatever the data says.
            logp = F.log_softmax(out.logits.float(), dim=-1)  # (B, T, V)
            entropy = -(logp.exp() * logp).sum(-1).mean()
            loss = loss + self.collapse_weight * entropy
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self(batch["input_ids"], labels=batch["labels"]).loss
        self.log("val_loss", loss, on_epoch=True, prog_bar=True)
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": hp.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=hp.learning_rate,
            betas=(0.9, 0.95),
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: lr_lambda(
                step, warmup_steps=hp.warmup_steps, max_steps=hp.max_steps, min_lr_ratio=hp.min_lr_ratio
            ),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# -------------------------------------------------------------------------- corpus

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_source_files() -> list[Path]:
    """The running Python's standard-library ``*.py`` files, sorted by relative path.

    Third-party packages (``site-packages``) and test suites are skipped. The list is
    deterministic for a given Python installation.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def collect_text_files(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Files named by ``paths``, folders expanded recursively (hidden entries skipped).

    The order is that of ``paths``, each folder's files sorted. Whether a file is text
    is decided when it is read (:func:`read_corpus`).

    Raises:
        FileNotFoundError: a path does not exist.
    """
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = []
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                found.extend(Path(dirpath, f) for f in filenames if not f.startswith("."))
            files.extend(sorted(found, key=lambda p: p.relative_to(path).as_posix()))
        else:
            raise FileNotFoundError(f"--data path does not exist: {path}")
    return files


def read_corpus(files: Sequence[Path], max_bytes: int) -> list[str]:
    """Read ``files`` in order as UTF-8 documents until ``max_bytes`` bytes are collected.

    Files that are not valid UTF-8, contain NUL bytes or are empty are skipped; the
    last document is cut so that the total is at most ``max_bytes``.
    """
    if max_bytes < 1:
        raise ValueError(f"`max_bytes` must be >= 1, got {max_bytes!r}")
    docs: list[str] = []
    total = 0
    for path in files:
        room = max_bytes - total
        try:
            with path.open("rb") as f:
                raw = f.read(room)  # never more than the budget, however big the file
                cut = bool(f.read(1))
        except OSError:
            continue
        if not raw or b"\x00" in raw:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            # A cut may split the last character; any other invalid byte means "not text".
            if not (cut and err.reason == "unexpected end of data"):
                continue
            raw = raw[: err.start]
            text = raw.decode("utf-8")
        if text:
            docs.append(text)
            total += len(raw)
        if cut or total >= max_bytes:  # the budget is spent
            break
    return docs


# ----------------------------------------------------------------------- tokenizer


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as err:
        raise ImportError(
            f"The example needs the `tokenizers` library to train its BPE tokenizer: {_INSTALL_HINT}"
        ) from err
    return tokenizers


def train_tokenizer(docs: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style) on ``docs``.

    The vocabulary holds the 256 byte symbols, :data:`END_OF_TEXT` (id 0) and merges up
    to ``vocab_size`` entries; it can be smaller when the corpus runs out of merges.
    """
    tokenizers = _import_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer=trainer)
    return tokenizer


def encode_documents(tokenizer: Tokenizer, docs: Sequence[str]) -> Tensor:
    """Encode ``docs`` into one 1-D int64 token stream, each document followed by END_OF_TEXT."""
    eot = tokenizer.token_to_id(END_OF_TEXT)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(list(docs)):
        ids.extend(encoding.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------------------- data


class TokenWindows(Dataset[dict[str, Tensor]]):
    """Non-overlapping windows of ``block_size`` tokens: ``{"input_ids", "labels"}``, both (T,).

    ``labels`` equals ``input_ids`` (the model shifts internally), as Hugging Face
    causal-LM data collators produce.
    """

    def __init__(self, tokens: Tensor, block_size: int) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"expected a 1-D token stream, got shape {tuple(tokens.shape)}")
        if len(tokens) < block_size:
            raise ValueError(
                f"token stream of {len(tokens)} tokens is shorter than one window of {block_size}:"
                " use more data (--max-corpus-mb) or a smaller --block-size"
            )
        n = len(tokens) // block_size
        self.windows = tokens[: n * block_size].view(n, block_size)  # (N, T)

    def __len__(self) -> int:
        return self.windows.size(0)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        window = self.windows[index]
        return {"input_ids": window, "labels": window.clone()}


class TokenDataModule(pl.LightningDataModule):
    """Train/validation windows over a token stream; validation is its last ``val_fraction``.

    The data live in memory, so the loaders use no worker processes.
    """

    def __init__(self, tokens: Tensor, *, block_size: int, batch_size: int, val_fraction: float = 0.05) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"`val_fraction` must be in (0, 1), got {val_fraction!r}")
        if batch_size < 1:
            raise ValueError(f"`batch_size` must be >= 1, got {batch_size!r}")
        n_val = max(block_size, int(len(tokens) * val_fraction))
        self.train_tokens = tokens[:-n_val]
        self.val_tokens = tokens[-n_val:]
        self.batch_size = batch_size
        self.train_set = TokenWindows(self.train_tokens, block_size)
        self.val_set = TokenWindows(self.val_tokens, block_size)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False)
