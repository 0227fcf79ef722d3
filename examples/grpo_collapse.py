"""GRPO driven into entropy collapse on a CPU in about a minute, watched by headwatch (docs/rl.md).

A tiny Llama (vocab 256, hidden 32, one layer, built from a ``LlamaConfig``: no download) is trained by TRL's
``GRPOTrainer`` on one prompt, 8 completions of up to 8 tokens sampled at temperature 0.7, with a reward that
counts one token (``w7``, at most 8): the policy's entropy collapses and its reward stalls at 7. headwatch
reports the entropy of the sampling distribution (equal to TRL's ``entropy``), splits it by token frequency
and fires the RL preset's alert (``rl_collapse_rules``) before the reward flattens, and says by how many steps.

    python examples/grpo_collapse.py                 # the collapse
    python examples/grpo_collapse.py --remedy        # the same run with an entropy bonus (TRL entropy_coef)
    python examples/grpo_collapse.py --plot docs/rl_collapse.png   # both runs, one picture
    tensorboard --logdir runs/grpo_collapse          # the dashboard: the headwatch section, rl/ charts

Prints one line per step (entropy, reward), the alerts with their steps, and the lead of the first alert over
the reward's plateau (the first step at 90% of the run's best reward).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

V, EOS, PAD = 256, 255, 254


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(V - 2)} | {"<pad>": PAD, "<eos>": EOS}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def tiny_policy(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=PAD,
        eos_token_id=EOS, bos_token_id=None, initializer_range=0.6,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[EOS] *= 2.5  # some completions end early
    return model


def reward_w7(completions, **kwargs):
    return [float(c.count("w7")) for c in completions]


def main(argv: list[str] | None = None) -> dict:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from headwatch.alerts import rl_collapse_rules
    from headwatch.integrations.transformers import HeadwatchCallback

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--remedy", action="store_true", help="an entropy bonus (GRPOConfig.entropy_coef)")
    parser.add_argument("--entropy-coef", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/grpo_collapse")
    parser.add_argument("--plot", default=None, help="also run the other variant and save both to this PNG")
    args = parser.parse_args(argv)
    if args.plot:
        rest = [a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--remedy",)]
        rest = [a for i, a in enumerate(rest) if a != "--plot" and (i == 0 or rest[i - 1] != "--plot")]
        runs = {"collapse": main(rest), f"remedy (--remedy, entropy_coef {args.entropy_coef})": main(rest + ["--remedy"])}
        plot(runs, args.plot)
        return runs["collapse"]

    out = Path(args.out) / ("remedy" if args.remedy else "collapse")
    config = GRPOConfig(
        output_dir=str(out), max_steps=args.steps, logging_steps=1, per_device_train_batch_size=8, num_generations=8,
        max_completion_length=8, temperature=0.7, learning_rate=args.lr, report_to="tensorboard",
        use_cpu=True, save_strategy="no", disable_tqdm=True, bf16=False, use_vllm=False,
        seed=args.seed, entropy_coef=args.entropy_coef if args.remedy else 0.0,
    )  # fmt: skip
    callback = HeadwatchCallback(monitors=["tokens", "logits", "gradients"], alert=rl_collapse_rules(),
                                 figure_every_n_steps=0)  # fmt: skip
    data = Dataset.from_dict({"prompt": ["w1 w2 w3"] * 8 * args.steps})
    trainer = GRPOTrainer(model=tiny_policy(args.seed), reward_funcs=reward_w7, args=config, train_dataset=data,
                          processing_class=word_tokenizer(), callbacks=[callback])  # fmt: skip
    path = out / "headwatch_alerts.jsonl"
    start = path.stat().st_size if path.exists() else 0  # the file is appended to: read this run's alerts only
    trainer.train()

    history = trainer.state.log_history
    rows = {r["step"]: r for r in history if "entropy" in r}
    ours = {r["step"]: r for r in history if "headwatch/logits/entropy" in r}
    print("step  entropy(TRL)  entropy(headwatch)  reward  rare-token share (nats)")
    for step in sorted(rows):
        h = ours.get(step, {})
        print(f"{step:4d}  {rows[step]['entropy']:12.4f}  {h.get('headwatch/logits/entropy', float('nan')):18.4f}  "
              f"{rows[step]['reward']:6.3f}  {h.get('headwatch/rl/entropy_share/rare', float('nan')):.4f}")
    alerts = []
    if path.exists():  # headwatch creates the file at its first alert
        with path.open("rb") as f:
            f.seek(start)
            alerts = [json.loads(line) for line in f.read().decode().splitlines()]
    alerts = [a for a in alerts if a.get("kind", "fired") == "fired"]
    print("alerts:", [(a["step"], a["rule"], a["severity"]) for a in alerts] or "none")
    reward = {s: r["reward"] for s, r in rows.items()}
    plateau = plateau_step(reward)
    print(f"reward: best {max(reward.values()):.3f}, first at 90% of it at step {plateau}", end="")
    print(f"; the first alert {plateau - alerts[0]['step']} steps before" if alerts else "; no alert")
    return {"entropy": {s: r["entropy"] for s, r in rows.items()}, "reward": reward, "alerts": alerts,
            "plateau": plateau}  # fmt: skip


def plateau_step(reward: dict[int, float]) -> int:
    """The first step whose reward is at least 90% of the run's best: where the reward curve flattens."""
    return min(s for s, r in reward.items() if r >= 0.9 * max(reward.values()))


def plot(runs: dict[str, dict], path: str) -> None:
    """Entropy (left axis) and reward (right axis) of each run, the alerts as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 3.6), sharey=True)
    for ax, (name, run) in zip(axes, runs.items()):
        steps = sorted(run["entropy"])
        ax.plot(steps, [run["entropy"][s] for s in steps], color="tab:blue", label="entropy at T (nats)")
        ax.set_xlabel("step")
        ax.set_title(name)
        twin = ax.twinx()
        twin.plot(steps, [run["reward"][s] for s in steps], color="tab:green", label="reward")
        twin.set_ylim(0, 8.5)
        twin.axvline(run["plateau"], color="tab:green", ls=":", lw=1)
        twin.annotate("reward at 90% of its best", (run["plateau"], 0.3), fontsize=7, rotation=90, ha="right",
                      color="tab:green")  # fmt: skip
        for a in run["alerts"]:
            color = "tab:red" if a["severity"] == "critical" else "tab:orange"
            ax.axvline(a["step"], color=color, ls="--", lw=1)
            ax.annotate(f"{a['rule']} ({a['severity']})", (a["step"], ax.get_ylim()[1] * 0.8), fontsize=7,
                        rotation=90, ha="right", va="top", color=color)  # fmt: skip
        ax.legend(loc="upper left", fontsize=7)
        twin.legend(loc="upper right", fontsize=7)
    axes[0].set_ylabel("entropy of softmax(logits / T), nats")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("saved", path)


if __name__ == "__main__":
    main()
