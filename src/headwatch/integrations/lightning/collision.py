"""``SynonymCollisionMonitor``: rare tokens whose rows became near-duplicates of other rows (Lightning adapter)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from headwatch.errors import check_choice
from headwatch.core.collision import DEFAULT_TAU, SynonymCollision, decode_token
from headwatch.core.figures import check_figure_argument, matplotlib_available
from headwatch.integrations.lightning.frequency import TokenFrequency
from headwatch.integrations.lightning.callback import MonitorCallback

__all__ = ["DEFAULT_TAU", "SynonymCollisionMonitor", "decode_token"]


class SynonymCollisionMonitor(SynonymCollision, MonitorCallback):
    """Rare-token synonym collision: rare tokens whose head or embedding row is a near-duplicate.

    For a matrix ``W`` (head rows, and embedding rows when untied; a tied matrix is measured
    once, reported as ``head``) and the rare tokens ``R`` (the trainer's
    :class:`~headwatch.TokenFrequency` definition), the rows are first corrected for common
    drift ("all-but-the-top", Mu & Viswanath 2018): ``x' = (x - mu) - U U^T (x - mu)`` with
    ``mu`` the mean and ``U`` the top ``k`` principal directions of the pairable rows
    (:func:`headwatch.functional.drift.remove_top_directions`). Rare token ``r`` *collides*
    when ``nn_cos'(r) = max_{j pairable, j != r} cos(W'_r, W'_j) >= tau``; the collision
    rate is ``|{r in R : nn_cos'(r) >= tau}| / |R|`` (exact neighbours by chunked matrix
    products) on a panel of rare tokens: a fixed seeded selection, the same rows at every probe and
    on every process (trends are paired), 1024 rows (all when fewer) doubled after each probe whose
    95% Wilson half-width exceeds 0.01 (``max_rare`` fixes it). Pairable rows: valid, seen,
    non-zero and finite (never-seen, padded and zero rows are on neither side, and counted).
    The drift itself (the raw-cosine rate, the rare rows' mean cosine to their mean
    direction, the removed variance share) is logged under ``collision/drift/``.
    Supervised mode: ``synonym_groups`` (token ids, or strings with a ``tokenizer``) also
    give the within-group pair rate and median partner rank on the corrected rows and, on
    the logits path, the prediction confusion over every training batch since the last
    measurement (and over each validation epoch), with positions and targets read by the one
    :class:`~headwatch.core.BatchFormat`.

    Every process measures (the weights and the summed counts are the same everywhere), so
    every rank publishes the same keys on the same steps: every ``every_n_steps`` steps and
    at the end of each training epoch.

    Args:
        tau: collision threshold on the cosine (default 0.9).
        every_n_steps: measure every this many steps; None: ten times the Trainer's
            ``log_every_n_steps``.
        on_epoch_end: also measure at the end of each training epoch.
        figures: nearest-neighbour cosine histograms, rare vs frequent
            (``headwatch/collision/nn_similarity_<m>``); ``"auto"``: when matplotlib is installed.
        **kwargs: the arguments of the core :class:`~headwatch.core.SynonymCollision` (keyword only;
            listed under "Other Parameters").

    Other Parameters:
        max_rare (int | None): rare tokens in the panel, fixed; None (default): 1024, doubled while the
            rate's Wilson half-width exceeds 0.01.
        max_per_bucket (int): rows sampled per frequency bucket for the per-bucket similarity.
        top_pairs (int): number of most similar colliding pairs reported.
        synonym_groups (Sequence[Sequence[int | str]] | None): optional list of groups (token ids or strings).
        tokenizer (Any): decodes pairs to text and encodes string synonyms.
        head (str | nn.Module | None): module or dotted name; found automatically if None.
        embedding (str | nn.Module | None): module or dotted name; found automatically if None.
        seed (int): base seed of the samples.
        max_chunk_bytes (int): working-memory bound of the neighbour search (default 64 MiB).
        prefix (str): first component of every metric name.
        strict (bool): raise on a failure to measure instead of warning once.
        batch_format (BatchFormat | None): how to read targets for the confusion rate (``targets_fn``,
            ``shift_labels``, ``mask_fn``, ``ignore_index``).
        k (int | None): principal directions removed before the neighbour search; None:
            ``max(1, round(d_model / 100))``.
        include_unseen (bool): let never-seen tokens be nearest neighbours (default: they are not).

    Logged metrics (``<m>`` is ``head``, and ``embedding`` when untied; definitions in
    :mod:`headwatch.names`): ``collision/rare_rate_<m>`` with ``rare_rate_<m>_low``, ``rare_rate_<m>_high``
    (its 95% Wilson interval) and ``rare_measured_<m>``, ``collision/drift/raw_rate_<m>``,
    ``drift/mean_cos_<m>``, ``drift/removed_variance_<m>``,
    ``collision/<bucket>/<m>_nn_cosine_mean``, ``collision/rare_count``, ``rare_sample_size``,
    ``unseen_count``, ``invalid_count``, ``zero_count_<m>``, ``nonfinite_count_<m>``;
    supervised: ``synonym_pair_rate_<m>``, ``synonym_partner_rank_<m>``, ``synonym_pairs``,
    ``synonym_skipped_pairs``, ``synonym_confusion_rate``, ``synonym_confusion_positions``
    (and ``collision/val/`` ones per validation epoch); text
    ``collision/top_pairs_<m>``; image ``collision/nn_similarity_<m>``.
    """

    def __init__(
        self,
        tau: float = DEFAULT_TAU,
        every_n_steps: int | None = None,
        on_epoch_end: bool = True,
        *,
        figures: bool | str = "auto",
        **kwargs: Any,
    ) -> None:
        # the adapter's own arguments; the core (SynonymCollision) declares and checks the rest
        check_choice("figures", figures, (True, False, "auto"))
        if figures is True:
            check_figure_argument(1, "figures")
        draw = figures is True or (figures == "auto" and matplotlib_available())
        super().__init__(None, tau, figures=draw, on_epoch_end=on_epoch_end, every_n_steps=every_n_steps, **kwargs)
        self.log_every_n_steps = every_n_steps
        self.figures = figures

    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super()._attach(trainer, pl_module, stage)
        self.frequency = TokenFrequency.of_trainer(trainer, pl_module, self.embedding)
        where = "the tied matrix" if self.tied else "head and embedding"
        # a cadence of the user's is kept; else the overhead budget spaces the probes (overhead/probe_interval)
        when = "" if self.log_every_n_steps else ", or further apart as the overhead budget sets (overhead/probe_interval)"
        self._info_once(
            f"headwatch: synonym collision of rare tokens in {where}, tau={self.tau}, every {self.schedule.every} steps{when}"
        )

    # ---------------------------------------------------------------- validation (synonym confusion)
    def _measuring_validation(self, trainer: pl.Trainer) -> bool:
        return self._table is not None and not trainer.sanity_checking and self.model is not None
