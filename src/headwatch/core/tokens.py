"""Token ids <-> text for the collision monitor: decode a row id, encode a synonym group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from headwatch.errors import HeadwatchError, check_sequence


def decode_token(tokenizer: Any, token_id: int) -> str:
    """A token's text from a ``tokenizers.Tokenizer``, a Hugging Face tokenizer, or a callable."""
    if tokenizer is None:
        return str(token_id)
    if callable(tokenizer) and not hasattr(tokenizer, "decode"):
        return str(tokenizer(token_id))
    if hasattr(tokenizer, "decode"):
        try:
            return str(tokenizer.decode([token_id]))
        except Exception:  # noqa: BLE001 - fall back to the vocabulary entry
            pass
    if hasattr(tokenizer, "id_to_token"):
        return str(tokenizer.id_to_token(token_id))
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        return str(tokenizer.convert_ids_to_tokens(token_id))
    raise HeadwatchError(
        f"cannot decode with a {type(tokenizer).__name__}: pass a tokenizers.Tokenizer, a Hugging Face "
        "tokenizer, or a callable id -> str"
    )


def _is_entry(word: Any) -> bool:
    """A token id (an int or a numpy integer, not a bool) or a string: what :func:`encode_group` reads."""
    return isinstance(word, str) or (not isinstance(word, bool) and hasattr(word, "__index__"))


def check_synonym_groups(name: str, value: Any) -> list[list[Any]]:
    """Synonym groups: groups (read once, as a list; not a string), each a list or tuple of token ids or strings.

    The strings are encoded (with the tokenizer) by :func:`encode_group` when the monitor attaches.
    """
    groups = check_sequence(
        name, value, "groups, each a list or tuple of token ids or strings",
        lambda g: isinstance(g, (list, tuple)) and all(_is_entry(w) for w in g),
    )  # fmt: skip
    return [list(g) for g in groups]


def encode_group(tokenizer: Any, words: Sequence[Any]) -> list[int]:
    """Token ids of a synonym group given as ids or single-token strings."""
    ids: list[int] = []
    for word in words:
        if isinstance(word, bool):
            raise HeadwatchError(f"synonym group entry {word!r} is a bool, not a token id or a string")
        if isinstance(word, int) or (hasattr(word, "__index__") and not isinstance(word, str)):
            ids.append(int(word.__index__()))  # ints, numpy integers
            continue
        if not isinstance(word, str):
            raise HeadwatchError(f"synonym group entry {word!r} is a {type(word).__name__}: token ids or strings only")
        if tokenizer is None:
            raise HeadwatchError(f"synonym group entry {word!r} is a string: pass tokenizer= to encode it")
        if hasattr(tokenizer, "token_to_id") and tokenizer.token_to_id(word) is not None:
            ids.append(int(tokenizer.token_to_id(word)))
            continue
        try:  # Hugging Face tokenizers add BOS/EOS unless told not to
            encoded = tokenizer.encode(word, add_special_tokens=False)
        except TypeError:
            encoded = tokenizer.encode(word)
        token_ids = list(getattr(encoded, "ids", encoded))
        if len(token_ids) != 1:
            raise HeadwatchError(
                f"synonym {word!r} is {len(token_ids)} tokens ({token_ids}); synonym groups are of single tokens"
            )
        ids.append(int(token_ids[0]))
    return ids
