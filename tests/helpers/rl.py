"""GRPO runs for the tests: the example's peaked policy and word tokenizer, a reward, values by step."""

from __future__ import annotations

from examples.grpo_collapse import V, word_tokenizer  # noqa: F401 - the example's ids and tokenizer, for the tests
from examples.grpo_collapse import tiny_policy as _example_policy


def tiny_policy(seed: int = 0):
    """The example's peaked policy (large initial weights: entropy well under log V, so the temperature matters),
    which ends some completions early (a large end-of-sequence row: completions of several lengths, padded)."""
    return _example_policy(seed)


def reward_w7(completions, **kwargs):
    return [float(c.count("w7")) for c in completions]


def by_step(history, key):
    return {r["step"]: r[key] for r in history if key in r}
