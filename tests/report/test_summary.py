"""The end-of-training summary's words match its figures: a rise is called a rise, a collision rate is called a
rate, an RL run's NLL is that of the sampled tokens, and the values of a matrix the run no longer has (after an
untie) are not said as its last word."""

from __future__ import annotations

from headwatch.report.summary import SummarySink

P = "headwatch"


def said(published: list[tuple[int, dict[str, float]]]) -> str:
    out: list[str] = []
    sink = SummarySink(out=out.append)
    for step, numbers in published:
        sink.publish({f"{P}/{k}": v for k, v in numbers.items()}, None, step, False)
    sink.end(published[-1][0])
    assert len(out) <= 1
    return out[0] if out else ""


def test_an_entropy_that_rose_is_said_to_have_risen():
    text = said([(4, {"logits/entropy": 5.0, "logits/kl_to_uniform": 1.0}), (9, {"logits/entropy": 5.1, "logits/kl_to_uniform": 0.9})])
    assert "5 -> 5.1 nats" in text and "rose 2% since step 4" in text and "fell" not in text


def test_the_raw_collision_rate_is_said_as_a_rate():
    text = said([(9, {"collision/rare_rate_head": 0.02, "collision/drift/raw_rate_head": 0.598})])
    assert "0.02 of rare head rows near-duplicate beyond drift; 0.598 before the rows' common drift is removed" in text
    assert "cosine" not in text


def test_after_an_untie_the_tied_values_are_not_said():
    tied = {"grad/shared_row_density": 1.0, "grad/tied_flow_conflict_fraction": 0.56, "grad/tied_flow_cosine_mean": -0.01}
    untied = {"grad/embedding_row_density": 0.4, "grad/head_row_density": 1.0}
    text = said([(9, tied), (19, untied), (29, untied)])
    assert "embedding 0.4, head 1 of the valid rows" in text
    assert "shared" not in text and "tied flows" not in text
    # a tied run keeps them
    text = said([(9, tied), (19, tied)])
    assert "shared 1" in text and "0.56 of the rows pulled both ways" in text


def test_an_rl_runs_nll_is_said_as_the_sampled_tokens_not_as_the_loss():
    """Under an RL trainer the labels are the sampled tokens and the reference is the trainer's NLL of them, not the
    policy-gradient loss (near 0, of either sign): the line names the sampled tokens and the temperature."""
    checked = {"logits/target_nll": 0.6293, "debug/check/reference_nll": 0.6293, "check/nll_gap": 0.0}
    text = said([(40, {**checked, "rl/temperature": 0.7})])
    assert "sampled NLL      0.6293 nats at the last logging step, of the sampled tokens at T = 0.7" in text
    assert "not the RL loss" in text and "the loss computed on it" not in text and "target NLL" not in text
    text = said([(40, checked)])  # a supervised run keeps its words
    assert "target NLL       0.6293 nats at the last logging step; the loss computed on it 0.6293" in text
    assert said([(40, {"rl/temperature": 0.7})]) == ""  # the temperature without an NLL: no NLL line


def test_the_nll_is_compared_with_the_loss_of_its_own_step_only():
    """A last step whose loss is not finite publishes no reference NLL nor gap: the summary must not pair its NLL
    with an earlier step's reference (other tokens) and call the gap 0."""
    checked = {"rl/temperature": 0.7, "logits/target_nll": 1.0, "debug/check/reference_nll": 1.0, "check/nll_gap": 0.0}
    nan = float("nan")
    last = {"rl/temperature": 0.7, "logits/target_nll": 3.0, "debug/check/reference_nll": nan, "check/nll_gap": nan}
    text = said([(2, checked), (4, last)])
    assert "  target NLL       3 nats (no trainer loss of that step to compare)" in text and "gap" not in text
    # a check that failed at the last step withheld its logits/*: said as a failure, not paired with the NLL before
    failed = {"debug/check/reference_nll": 2.0, "check/nll_gap": -1.0, "check/mismatch": 1.0}
    text = said([(2, checked), (4, failed)])
    assert "target NLL       1 nats at step 2; the self-check failed at step 4, beyond its tolerance" in text
    assert "gap" not in text and "within" not in text


def test_a_resumed_run_summarises_the_whole_run(tmp_path):
    """The summary's first figures are saved with the run's state: after a resume from a checkpoint the summary
    starts at the first logging step of the whole run (the entropy then, as published), not of the resume."""
    import torch

    from headwatch import Headwatch
    from tests.helpers.loop import Tiny, train_step

    torch.manual_seed(0)
    model, out = Tiny(), []
    hw = Headwatch(model, monitors=["logits"], log_every_n_steps=1, figure_every_n_steps=None, overhead_budget=None)
    first = train_step(hw, model, 0)["headwatch/logits/entropy"]
    for step in (1, 2):
        train_step(hw, model, step)
    torch.save(hw.state_dict(), tmp_path / "state.pt")
    hw.close()
    resumed = Headwatch(model, monitors=["logits"], log_every_n_steps=1, figure_every_n_steps=None, overhead_budget=None)
    resumed.summary.out = out.append
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    last = [train_step(resumed, model, step)["headwatch/logits/entropy"] for step in (3, 4)][-1]
    resumed.close()
    assert len(out) == 1 and "since step 0" in out[0], out
    assert resumed.summary.figures["entropy_first"] == float(first)
    assert resumed.summary.figures["entropy_last"] == float(last)


def test_a_damaged_summary_state_is_said_and_starts_empty():
    sink = SummarySink()
    assert sink.load_sink_state({"first": {}, "last": {}, "val_last": {}}) is None
    problem = sink.load_sink_state({"first": {"headwatch/logits/entropy": (0, float("nan"))}, "last": {}, "val_last": {}})
    assert problem is not None and "invalid first entry" in problem and sink.first == {}
    assert "must be a dict" in sink.load_sink_state(["first"])
