"""``headwatch cost``: what untying the output head costs, in parameters and bytes, exactly.

Untying gives ``lm_head`` its own ``(vocab_size, d_model)`` matrix, so it adds exactly
``P = vocab_size * d_model`` parameters (a bias, if any, is never tied). Memory, in bytes, for
those ``P`` parameters (activations and the ``(B, T, V)`` logits are not included):

- weights: ``4 P`` in fp32, ``2 P`` in bf16;
- training, fp32: weights ``4`` + gradients ``4`` + AdamW moments ``m, v`` in fp32 ``8``
  = ``16 P``;
- training, bf16 weights and gradients, fp32 moments: ``2 + 2 + 8`` = ``12 P``;
- training, bf16 with an fp32 master copy (mixed precision as Megatron/DeepSpeed do it):
  ``2 + 2 + 4 + 8`` = ``16 P``;
- per GPU under FSDP (weights, gradients and optimizer state all sharded, ``FULL_SHARD`` /
  ``fully_shard``) over ``W`` GPUs: ``ceil(P / W)`` parameters per GPU times the bytes per
  parameter above.

The share of the model is ``P / N_untied`` with ``N_untied = N_tied + P``, the parameters of
the model with its head untied (``N_tied`` without); ``N`` is counted from the config by
building the model on the ``meta`` device with ``transformers`` (no memory, no download),
or given with ``--params`` (the model as its config ships it: tied or not).

Usage::

    headwatch cost --config path/to/config.json [--world-size 8]
    headwatch cost --vocab-size 128256 --d-model 4096 [--params 8030261248 --no-tied]
    python -m headwatch.remedies.cost --readme-table
"""

from __future__ import annotations

import argparse
import json
import math
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headwatch.errors import HeadwatchError, check_bool, check_instance, check_int, check_optional, check_positive_int, check_str

TRAINING_BYTES_PER_PARAM = {
    "fp32 (weights, grads, AdamW m+v)": 4 + 4 + 8,
    "bf16 weights+grads, fp32 AdamW m+v": 2 + 2 + 8,
    "bf16 + fp32 master + fp32 AdamW m+v": 2 + 2 + 4 + 8,
}
"""Bytes per parameter while training with AdamW, by precision regime."""


def _decoder(
    model_type: str, vocab_size: int, hidden_size: int, intermediate_size: int, layers: int, heads: int, kv_heads: int,
    tied: bool, head_dim: int | None = None,
) -> dict[str, Any]:
    """The fields of a Llama-style decoder's ``config.json`` that set its parameter count (``head_dim`` where the
    published config states it)."""
    config: dict[str, Any] = dict(
        model_type=model_type, vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
    )
    if head_dim is not None:
        config["head_dim"] = head_dim
    config["tie_word_embeddings"] = tied
    return config


KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    # name -> the fields of its published config.json that set the parameter count, one model a line:
    # _decoder(model_type, vocab_size, hidden_size, intermediate_size, layers, heads, kv_heads, tied[, head_dim])
    "Llama 3 8B": _decoder("llama", 128256, 4096, 14336, 32, 32, 8, False),
    "Llama 3 70B": _decoder("llama", 128256, 8192, 28672, 80, 64, 8, False),
    "Llama 3.1 405B": _decoder("llama", 128256, 16384, 53248, 126, 128, 8, False),
    "Llama 3.2 1B": _decoder("llama", 128256, 2048, 8192, 16, 32, 8, True, head_dim=64),
    "Llama 3.2 3B": _decoder("llama", 128256, 3072, 8192, 28, 24, 8, True, head_dim=128),
    "Mistral 7B": _decoder("mistral", 32000, 4096, 14336, 32, 32, 8, False),
    "Gemma 2 2B": _decoder("gemma2", 256000, 2304, 9216, 26, 8, 4, True, head_dim=256),
    "Gemma 2 9B": _decoder("gemma2", 256000, 3584, 14336, 42, 16, 8, True, head_dim=256),
    "Qwen2.5 7B": _decoder("qwen2", 152064, 3584, 18944, 28, 28, 4, False),
    "GPT-2 small": dict(model_type="gpt2", vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024,
                        tie_word_embeddings=True),
}

_D_MODEL_KEYS = ("hidden_size", "d_model", "n_embd", "dim")


@dataclass(frozen=True)
class UntieCost:
    """The cost of untying one ``(vocab_size, d_model)`` head; every field derived in :func:`untie_cost`."""

    vocab_size: int
    d_model: int
    params_added: int  # P = vocab_size * d_model
    params_tied: int | None  # N_tied: the model with its head tied
    params_untied: int | None  # N_untied = N_tied + P
    world_size: int
    shipped_tied: bool | None

    @property
    def share_of_untied(self) -> float | None:
        """``P / N_untied``: the head's share of the untied model."""
        return None if self.params_untied is None else self.params_added / self.params_untied

    def weight_bytes(self, bytes_per_param: int) -> int:
        return self.params_added * bytes_per_param

    def per_gpu_bytes(self, bytes_per_param: int) -> int:
        """``ceil(P / W) * bytes_per_param``: FSDP full sharding over ``W`` GPUs."""
        return math.ceil(self.params_added / self.world_size) * bytes_per_param


MAX_VOCAB = 2**31 - 1
"""The largest ``vocab_size`` taken: token ids must fit an int32 (the largest vocabularies shipped hold ~262k rows)."""
MAX_D_MODEL = 2**20
"""The largest ``d_model`` taken (shipped models stay below 2**15)."""
MAX_WORLD_SIZE = 2**20
"""The largest ``world_size`` taken."""
MAX_PARAMS = 2**50
"""The largest ``params`` taken (about 10**15: a thousand times the largest models)."""
MAX_CONFIG_BYTES = 16 * 2**20
"""The largest config file read (a Hugging Face ``config.json`` holds a few kB)."""


def check_sizes(vocab_size: Any, d_model: Any, world_size: Any = 1) -> tuple[int, int, int]:
    """``(vocab_size, d_model, world_size)``, each an int in ``[1, MAX_*]``, else HeadwatchError naming it: an
    absurd size is a typo, and building it on the meta device would take minutes."""
    return (
        check_int("vocab_size", vocab_size, minimum=1, maximum=MAX_VOCAB),
        check_int("d_model", d_model, minimum=1, maximum=MAX_D_MODEL),
        check_int("world_size", world_size, minimum=1, maximum=MAX_WORLD_SIZE),
    )


def untie_cost(
    vocab_size: int, d_model: int, params: int | None = None, tied: bool | None = None, world_size: int = 1
) -> UntieCost:
    """Parameters added by untying a ``(vocab_size, d_model)`` head, and the model totals.

    Args:
        vocab_size: the matrix's rows ``V``.
        d_model: the matrix's columns (the width of a row).
        params: the model's parameter count as it ships (tied when ``tied``, untied otherwise);
            None when unknown (no shares then).
        tied: whether ``params`` counts a tied model (required with ``params``).
        world_size: GPUs over which FSDP shards the parameters.

    Raises:
        HeadwatchError: a size that is not an int >= 1 or is above its bound (:func:`check_sizes`, ``params`` at
            most 2**50); ``tied`` not None or a bool; ``params`` without ``tied``; ``params`` smaller than what the
            untied matrices alone need.
    """
    V, d, W = check_sizes(vocab_size, d_model, world_size)
    check_optional(check_int, "params", params, minimum=1, maximum=MAX_PARAMS)
    check_optional(check_bool, "tied", tied)
    P = V * d
    n_tied = n_untied = None
    if params is not None:
        if tied is None:
            raise HeadwatchError("`tied` must be True or False when `params` is given (is the count for a tied model?)")
        n_tied = params if tied else params - P
        if n_tied < P:
            raise HeadwatchError(
                f"`params`={params:,} is too small for a {V} x {d} embedding ({P:,} parameters) "
                f"{'' if tied else 'plus an untied head of the same size'}"
            )
        n_untied = n_tied + P
    return UntieCost(V, d, P, n_tied, n_untied, W, tied)


def count_parameters(config: dict[str, Any]) -> int | None:
    """Distinct parameters of the causal LM a Hugging Face config describes (tied matrices once).

    Built on the ``meta`` device (no memory, no download); None when ``transformers`` is not
    installed or does not know the ``model_type``.
    """
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        return None
    fields = dict(config)
    model_type = fields.pop("model_type", None)
    if model_type is None:
        return None
    try:
        hf_config = AutoConfig.for_model(model_type, **fields)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except Exception:  # noqa: BLE001 - an unknown or exotic architecture: the count is optional
        return None
    return sum(p.numel() for p in model.parameters())


def shape_from_config(config: dict[str, Any]) -> tuple[int, int, bool]:
    """``(vocab_size, d_model, tied)`` from a Hugging Face config dict (its text sub-config if any).

    Raises:
        HeadwatchError: not a JSON object; no ``vocab_size`` or no hidden size
            (``hidden_size``/``d_model``/``n_embd``); a ``tie_word_embeddings`` that is not a bool.
    """
    if not isinstance(config, dict):
        raise HeadwatchError(f"the config must be a JSON object (a Hugging Face config.json), got a {type(config).__name__}")
    text = config.get("text_config") or config
    if not isinstance(text, dict):
        raise HeadwatchError(f"the config's `text_config` must be a JSON object, got a {type(text).__name__}")
    vocab = text.get("vocab_size", config.get("vocab_size"))
    d = next((text[k] for k in _D_MODEL_KEYS if isinstance(text.get(k), int)), None)
    if not isinstance(vocab, int) or d is None:
        raise HeadwatchError(
            f"the config has no int `vocab_size` and hidden size ({'/'.join(_D_MODEL_KEYS)}); got vocab_size="
            f"{vocab!r}, keys {sorted(text)[:30]}; pass --vocab-size and --d-model instead"
        )
    tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings", True))
    if not isinstance(tied, bool):  # bool("false") is True: never guess
        raise HeadwatchError(f"the config's `tie_word_embeddings` must be true or false, got {tied!r}")
    return vocab, d, tied


def read_config(path: str | Path) -> dict[str, Any]:
    """A Hugging Face ``config.json`` (or the folder holding it) as a dict.

    Raises:
        HeadwatchError: a missing file, one that is not a regular file (a FIFO would block the read forever, a
            device never end), one above 16 MiB, invalid JSON (or nested too deep to parse).
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise HeadwatchError(f"--config {str(path)!r}: not a regular file (a FIFO, a device or a folder); give a config.json")
        if info.st_size > MAX_CONFIG_BYTES:
            raise HeadwatchError(f"--config {str(path)!r}: {info.st_size:,} bytes, more than a config.json holds "
                                 f"(at most {MAX_CONFIG_BYTES:,} read)")
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:  # ValueError: bad JSON, bad UTF-8, an int too long
        reason = "nested too deep" if isinstance(err, RecursionError) else str(err).splitlines()[0][:200]
        raise HeadwatchError(f"--config {str(path)!r}: cannot read a JSON config: {reason}") from None


def _gb(n: int) -> str:
    return f"{n / 1e9:,.2f} GB"


def format_cost(cost: UntieCost, name: str = "") -> str:
    """The human-readable report :func:`main` prints (exact integers, GB = 1e9 bytes)."""
    check_instance("cost", cost, UntieCost)
    check_str("name", name, empty=True)
    P = cost.params_added
    lines = [
        f"untying the output head{f' of {name}' if name else ''}: vocab_size {cost.vocab_size:,} x d_model "
        f"{cost.d_model:,}",
        f"  parameters added        {P:,}  (vocab_size * d_model)",
    ]
    if cost.params_tied is not None:
        ships = "tied" if cost.shipped_tied else "untied"
        lines += [
            f"  model, tied             {cost.params_tied:,}",
            f"  model, untied           {cost.params_untied:,}  (ships {ships})",
            f"  share of untied model   {100 * cost.share_of_untied:.2f}%  (P / N_untied)",
        ]
    lines += [
        f"  weights fp32            {cost.weight_bytes(4):,} bytes ({_gb(cost.weight_bytes(4))})",
        f"  weights bf16            {cost.weight_bytes(2):,} bytes ({_gb(cost.weight_bytes(2))})",
        f"  training with AdamW     (bytes/param)  total  |  per GPU, FSDP over {cost.world_size}",
    ]
    for regime, b in TRAINING_BYTES_PER_PARAM.items():
        lines.append(
            f"    {regime:<36} ({b:>2})  {cost.weight_bytes(b):,} ({_gb(cost.weight_bytes(b))})  |  "
            f"{cost.per_gpu_bytes(b):,} ({_gb(cost.per_gpu_bytes(b))})"
        )
    return "\n".join(lines)


def readme_table(world_size: int = 8) -> str:
    """The Markdown table (docs/remedies.md) of :data:`KNOWN_CONFIGS`, every figure computed here."""
    check_positive_int("world_size", world_size)
    head = (
        "| model | vocab_size | d_model | ships | parameters (as shipped) | added by untying (V x d) "
        f"| share of untied model | fp32 weights | bf16 weights | training, bf16 + fp32 master + AdamW (16 B/param) "
        f"| per GPU, FSDP over {world_size} |\n|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    rows = [head]
    for name, config in KNOWN_CONFIGS.items():
        V, d, tied = shape_from_config(config)
        params = count_parameters(config)
        cost = untie_cost(V, d, params, tied, world_size)
        share = "n/a" if cost.share_of_untied is None else f"{100 * cost.share_of_untied:.2f}%"
        rows.append(
            f"| {name} | {V:,} | {d:,} | {'tied' if tied else 'untied'} | "
            f"{'n/a' if params is None else f'{params:,}'} | {cost.params_added:,} | {share} | "
            f"{_gb(cost.weight_bytes(4))} | {_gb(cost.weight_bytes(2))} | {_gb(cost.weight_bytes(16))} | {_gb(cost.per_gpu_bytes(16))} |"
        )
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    """``headwatch cost`` arguments."""
    parser = argparse.ArgumentParser(
        prog="headwatch cost",
        description="What untying the output head costs: parameters, share of the model, weight and "
        "training memory (AdamW), per GPU under FSDP. Exact integers.",
    )
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--config", metavar="PATH", help="a Hugging Face config.json (or its folder)")
    src.add_argument("--readme-table", action="store_true", help="print the table of well-known configs (docs/remedies.md)")
    parser.add_argument("--vocab-size", type=int, help="rows of the embedding (with --d-model, instead of --config)")
    parser.add_argument("--d-model", type=int, help="hidden size (with --vocab-size)")
    parser.add_argument("--params", type=int, help="the model's parameter count as it ships (overrides the count)")
    parser.add_argument(
        "--tied", action=argparse.BooleanOptionalAction, default=None,
        help="whether --params counts a tied model (default: the config's tie_word_embeddings, else tied)",
    )
    parser.add_argument(
        "--world-size", type=int, default=None, help="GPUs FSDP shards over (default 1; 8 for --readme-table)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``headwatch cost``; returns the exit status 0. A bad argument or config exits with status 2: argparse's
    own usage errors as argparse prints them, the rest (a size out of range, a file that is not a regular one, bad
    JSON) as one line ``headwatch cost: error: ...``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.readme_table:
            print(readme_table(8 if args.world_size is None else args.world_size))
            return 0
        name, params, tied = "", args.params, args.tied
        if args.config:
            config = read_config(args.config)
            V, d, config_tied = shape_from_config(config)
            check_sizes(V, d)  # before the model is built on the meta device
            tied = config_tied if tied is None else tied
            name = Path(args.config).name
            if params is None:
                # a multimodal config counts vision towers too: no share unless --params is given
                params = None if "text_config" in config else count_parameters(config)
        elif args.vocab_size is not None and args.d_model is not None:
            V, d = args.vocab_size, args.d_model
            tied = True if tied is None else tied
        else:
            parser.error("give --config PATH, or --vocab-size V and --d-model D")
        print(format_cost(untie_cost(V, d, params, tied, 1 if args.world_size is None else args.world_size), name))
    except HeadwatchError as err:
        parser.exit(2, f"headwatch cost: error: {' '.join(str(err).split())}\n")  # one line, exit status 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
