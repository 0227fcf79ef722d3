"""GRPO runs for the tests: the example's peaked policy and word tokenizer, a reward, a run of 4 steps, the test's own
record of each step (:class:`Recorder`), values by step."""

from __future__ import annotations

import torch

from examples.grpo_collapse import V, word_tokenizer  # noqa: F401 - the example's ids and tokenizer, for the tests
from examples.grpo_collapse import tiny_policy as _example_policy

STEPS = 4


def tiny_policy(seed: int = 0):
    """The example's peaked policy (large initial weights: entropy well under log V, so the temperature matters),
    which ends some completions early (a large end-of-sequence row: completions of several lengths, padded)."""
    return _example_policy(seed)


def reward_w7(completions, **kwargs):
    return [float(c.count("w7")) for c in completions]


def by_step(history, key):
    return {r["step"]: r[key] for r in history if key in r}


def prompts(n: int = 16):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    rows = [" ".join(f"w{i}" for i in torch.randint(0, V - 2, (3 + k % 3,), generator=g).tolist()) for k in range(n)]
    return Dataset.from_dict({"prompt": rows})


def grpo(tmp_path, temperature: float, callback, reward=reward_w7, **kw):
    from trl import GRPOConfig, GRPOTrainer

    opts = dict(
        output_dir=str(tmp_path), max_steps=STEPS, logging_steps=1, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, temperature=temperature, learning_rate=1e-2, report_to="none", use_cpu=True,
        save_strategy="no", disable_tqdm=True, bf16=False, use_vllm=False, seed=0,
    )  # fmt: skip
    opts.update(kw)
    return GRPOTrainer(model=tiny_policy(), reward_funcs=reward, args=GRPOConfig(**opts), train_dataset=prompts(),
                       processing_class=word_tokenizer(), callbacks=[callback])  # fmt: skip


class Recorder:
    """The test's own view of each step: TRL's completion mask, the fused head's output of the training forward,
    and the model's forwards without gradient (generation) per optimizer step."""

    def __init__(self, trainer):
        self.masks, self.fused, self.no_grad = [], [], []
        self.current = 0
        original = trainer._compute_loss

        def compute_loss(model, inputs):
            self.masks.append(inputs["completion_mask"].detach().clone())
            return original(model, inputs)

        trainer._compute_loss = compute_loss
        trainer.model.register_forward_hook(self.hook, with_kwargs=True)
        trainer.add_callback(self.callback())

    def hook(self, module, args, kwargs, output):
        if torch.is_grad_enabled() and kwargs.get("fused_lm_head"):
            self.fused.append((output.log_probs.detach().clone(), output.label_mask.clone()))
        elif not torch.is_grad_enabled():
            self.current += 1

    def callback(self):
        from transformers import TrainerCallback

        recorder = self

        class StepEnd(TrainerCallback):
            def on_step_begin(self, *a, **k):
                recorder.current = 0

            def on_step_end(self, *a, **k):
                recorder.no_grad.append(recorder.current)

        return StepEnd()
