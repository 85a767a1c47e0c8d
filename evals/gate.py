"""The decision: turn comparisons into checks, and checks into one verdict.

Rules (reference design G4): an endpoint passes only when the one-sided upper bound of its
accuracy drop is below the margin; it fails when the point drop already exceeds the margin,
or McNemar shows a significant drop beyond half the margin; otherwise it is inconclusive,
which fails unless the policy says otherwise. Hard fails (chance-level scorer, mismatched
prompts, more unparseable or runaway outputs, confident flips) fail regardless.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from evals import stats
from evals.drift import (
    Divergence,
    GenerationAgreement,
    ItemResult,
    LengthBucket,
    LogitParity,
    TaskComparison,
    compare_items,
    kl_growth,
    pool_items,
)
from evals.policy import GatePolicy

PASS, FAIL, INCONCLUSIVE, WARN, SKIPPED = "pass", "fail", "inconclusive", "warn", "skipped"
SIGNIFICANT_DROP_P = 0.01


@dataclass(frozen=True, slots=True)
class Check:
    """One rule applied to one measurement."""

    name: str
    status: str
    detail: str
    value: float | None = None
    threshold: float | None = None
    # value's two-sided bootstrap interval, where one is known, at the policy's interval_level: its ends
    # are the one-sided bounds at the policy's confidence, the level Tier 1's endpoints are held to
    interval: tuple[float, float] | None = None

    @property
    def marginal(self) -> bool:
        """The threshold lies inside the value's interval: another sample of text, or another
        machine's rounding, could put this check on the other side. An interval of no width (a
        value every resample gives) leaves nothing to chance."""
        return (self.interval is not None and self.threshold is not None
                and self.interval[0] < self.interval[1] and self.interval[0] <= self.threshold <= self.interval[1])


@dataclass(slots=True)
class GateOutcome:
    passed: bool
    checks: list[Check]
    comparisons: dict[str, TaskComparison]
    pooled: TaskComparison | None
    noise_floor: dict[str, TaskComparison] = field(default_factory=dict)
    noise_pooled: TaskComparison | None = None
    parity: LogitParity | None = None
    agreement: GenerationAgreement | None = None
    length_accuracy: dict[str, list[LengthBucket]] = field(default_factory=dict)  # generative tasks only
    divergences: list[Divergence] = field(default_factory=list)  # Tier 2's earliest partings, as text
    answers: TaskComparison | None = None  # the user's prompts with expected answers (gate --prompts)


def endpoint_status(comparison: TaskComparison, margin: float, confidence: float = 0.95) -> tuple[str, str]:
    """Non-inferiority decision for one endpoint, with the rule that decided it; an undecided one
    says how many items would decide it (`confidence` is the one-sided level of the drop bound)."""
    drop = -comparison.table.delta
    upper = comparison.drop_upper_bound
    if upper < margin:
        return PASS, f"upper bound of drop {upper:.4f} < margin {margin:.4f}"
    if drop > margin:
        return FAIL, f"point drop {drop:.4f} > margin {margin:.4f}"
    if comparison.mcnemar_drop_p < SIGNIFICANT_DROP_P and drop > margin / 2:
        return FAIL, f"significant drop (McNemar p={comparison.mcnemar_drop_p:.2g}) of {drop:.4f} > margin/2"
    rule = f"upper bound of drop {upper:.4f} >= margin {margin:.4f}"
    planned = max(drop, 0.0)  # a candidate that scored better is planned as no drop
    if planned >= margin:  # a drop at the margin itself: no number of items bounds it under
        return INCONCLUSIVE, rule + f"; the point drop {drop:.4f} is at the margin"
    rule += "; add items to decide"
    needed = stats.items_needed(planned, comparison.table.flip_rate, margin=margin, alpha=1 - confidence)
    if needed > comparison.table.num_items:  # the normal approximation; Newcombe's bound can be wider
        seen = "this run's" if drop >= 0 else "none, as this run's gain is not counted on"
        rule += (f" (about {needed} paired items, against {comparison.table.num_items} here, would bound a true "
                 f"drop of {planned:.4f} ({seen}) under the margin with 80% power)")
    return INCONCLUSIVE, rule


def compare_arms(
    policy: GatePolicy,
    baseline: dict[str, dict[int, ItemResult]],
    candidate: dict[str, dict[int, ItemResult]],
) -> tuple[dict[str, TaskComparison], TaskComparison | None]:
    """Per-task comparisons plus the pooled endpoint over the tasks marked `pooled`."""
    kwargs = _comparison_settings(policy)
    per_task = {spec.name: compare_items(spec.name, spec.metric, baseline[spec.name], candidate[spec.name], **kwargs)
                for spec in policy.tier1.tasks}
    pooled_names = [s.name for s in policy.tier1.tasks if s.endpoint == "pooled"]
    if not pooled_names:
        return per_task, None
    base_pool, strata = pool_items({n: baseline[n] for n in pooled_names})
    cand_pool, _ = pool_items({n: candidate[n] for n in pooled_names})
    pooled = compare_items("pooled", "+".join(pooled_names), base_pool, cand_pool, strata=strata, **kwargs)
    return per_task, pooled


def _comparison_settings(policy: GatePolicy) -> dict:
    return {"confidence": policy.confidence, "confident_margin": policy.tier1.confident_margin,
            "num_resamples": policy.bootstrap_resamples, "seed": policy.seed}


EXPECTED_ANSWERS = "tier2.expected_answers"


def compare_answers(policy: GatePolicy, baseline: dict[int, ItemResult],
                    candidate: dict[int, ItemResult]) -> TaskComparison:
    """The arms' right and wrong answers to the user's own prompts (gate --prompts with
    "expected"), paired as a task's items are."""
    return compare_items(EXPECTED_ANSWERS, "contains expected", baseline, candidate, **_comparison_settings(policy))


def decide(
    policy: GatePolicy,
    comparisons: dict[str, TaskComparison],
    pooled: TaskComparison | None,
    *,
    noise_pooled: TaskComparison | None = None,
    parity: LogitParity | None = None,
    parity_skip_reason: str | None = None,
    parity_failure: str | None = None,
    agreement: GenerationAgreement | None = None,
    answers: TaskComparison | None = None,
) -> list[Check]:
    """Apply every rule of the policy; the verdict is pass only if no check fails. `answers` are
    the arms' answers to the user's own prompts, judged with Tier 1's pooled margin;
    `parity_failure` says why Tier 0 could not be measured (an arm's NaN logits): a failed check."""
    t1 = policy.tier1
    checks: list[Check] = []
    inconclusive_status = FAIL if policy.inconclusive == "fail" else PASS

    def endpoint(name: str, comparison: TaskComparison, margin: float) -> None:
        status, rule = endpoint_status(comparison, margin, policy.confidence)
        if status == INCONCLUSIVE:
            rule += f" (policy: inconclusive -> {inconclusive_status})"
            status = INCONCLUSIVE if inconclusive_status == FAIL else WARN
        checks.append(Check(name, status, rule, comparison.drop_upper_bound, margin))

    if pooled is not None:
        endpoint("tier1.pooled_drop", pooled, t1.max_pooled_drop)
        floor = noise_pooled.table.flip_rate if noise_pooled is not None else 0.0
        excess = pooled.table.flip_rate - floor
        num_items = pooled.table.num_items
        low, high = stats.wilson_interval(pooled.table.num_flips, num_items, policy.interval_level)
        checks.append(Check("tier1.flip_rate_above_floor", PASS if excess <= t1.max_flip_rate_above_floor else FAIL,
                            f"flip rate {pooled.table.flip_rate:.4f} - noise floor {floor:.4f}",
                            excess, t1.max_flip_rate_above_floor, (low - floor, high - floor)))
        confident_rate = pooled.num_confident_flips / num_items
        checks.append(Check("tier1.confident_flips", PASS if confident_rate <= t1.max_confident_flip_rate else FAIL,
                            f"{pooled.num_confident_flips} right->wrong flips with baseline margin > "
                            f"{t1.confident_margin}", confident_rate, t1.max_confident_flip_rate,
                            stats.wilson_interval(pooled.num_confident_flips, num_items, policy.interval_level)))

    secondary = [s for s in t1.tasks if s.endpoint != "separate"]
    holm = stats.holm_adjust([comparisons[s.name].mcnemar_drop_p for s in secondary]) if secondary else []
    for spec, adjusted in zip(secondary, holm, strict=True):
        if adjusted < 0.05:
            checks.append(Check(f"tier1.{spec.name}.drop", WARN,
                                f"per-task drop significant after Holm (p={adjusted:.3g}); secondary, not gating",
                                -comparisons[spec.name].table.delta))
    for spec in t1.tasks:
        comparison = comparisons[spec.name]
        if spec.endpoint == "separate":
            endpoint(f"tier1.{spec.name}.drop", comparison, spec.max_drop)
        if spec.chance is not None:
            line = stats.chance_threshold(comparison.table.num_items, spec.chance, t1.chance_sigma)
            for arm, acc in (("baseline", comparison.table.baseline_accuracy),
                             ("candidate", comparison.table.candidate_accuracy)):
                checks.append(Check(f"hard.{spec.name}.{arm}_above_chance", PASS if acc > line else FAIL,
                                    f"{arm} accuracy {acc:.4f} vs chance {spec.chance} + {t1.chance_sigma} sigma",
                                    acc, line))
        for label, base, cand, limit in (
            ("invalid_rate_rise", comparison.baseline_invalid_rate, comparison.candidate_invalid_rate,
             t1.max_invalid_rate_rise),
            ("runaway_rate_rise", comparison.baseline_max_tokens_rate, comparison.candidate_max_tokens_rate,
             t1.max_runaway_rate_rise),
        ):
            if base or cand:
                checks.append(Check(f"hard.{spec.name}.{label}", PASS if cand - base <= limit else FAIL,
                                    f"candidate {cand:.4f} vs baseline {base:.4f}", cand - base, limit))

    checks.extend(_tier0_checks(policy, parity, parity_skip_reason, parity_failure))
    if policy.tier2.enabled and agreement is not None:
        ok = agreement.mean_agreed_prefix >= policy.tier2.min_mean_agreed_prefix
        checks.append(Check("tier2.mean_agreed_prefix", PASS if ok else FAIL,
                            f"{agreement.num_identical}/{agreement.num_prompts} generations identical; "
                            f"mean tokens before divergence {agreement.mean_agreed_prefix:.1f}",
                            agreement.mean_agreed_prefix, policy.tier2.min_mean_agreed_prefix,
                            agreement.mean_agreed_prefix_interval))
    if answers is not None:
        endpoint(EXPECTED_ANSWERS, answers, t1.max_pooled_drop)
    if policy.point_checks == "interval":
        checks = [_undecided(c, inconclusive_status) if c.marginal else c for c in checks]
    return checks


def _undecided(check: Check, inconclusive_status: str) -> Check:
    """A point check whose interval holds its threshold, under point_checks = "interval": neither
    side is shown, as for an endpoint whose bound straddles its margin."""
    return replace(check, status=INCONCLUSIVE if inconclusive_status == FAIL else WARN,
                   detail=f"{check.detail}; the interval holds the threshold (policy: point_checks = interval, "
                          f"inconclusive -> {inconclusive_status})")


def _tier0_checks(policy: GatePolicy, parity: LogitParity | None, skip_reason: str | None,
                  failure: str | None = None) -> list[Check]:
    t0 = policy.tier0
    if not t0.enabled:
        return []
    if failure is not None:
        return [Check("tier0.finite_logits", FAIL, failure)]
    if parity is None:
        return [Check("tier0", SKIPPED, skip_reason or "not run")]
    o, within = parity.overall, parity.intervals.get
    checks = [
        Check("tier0.kl_mean", PASS if o.kl_mean <= t0.max_kl_mean else FAIL,
              f"mean KL(baseline||candidate) over {o.num_tokens} tokens", o.kl_mean, t0.max_kl_mean,
              within("kl_mean")),
        Check("tier0.kl_p99", PASS if o.kl_p99 <= t0.max_kl_p99 else FAIL, "p99 per-token KL", o.kl_p99, t0.max_kl_p99,
              within("kl_p99")),
        Check("tier0.top1_agreement", PASS if o.top1_agreement >= t0.min_top1_agreement else FAIL,
              "fraction of positions with the same argmax", o.top1_agreement, t0.min_top1_agreement,
              within("top1_agreement")),
    ]
    growth = kl_growth(parity)
    if growth is not None:
        checks.append(Check("tier0.kl_growth", PASS if growth <= t0.max_kl_growth else FAIL,
                            "p99 KL of the last position bucket over the first (KV-cache drift signature)",
                            growth, t0.max_kl_growth, within("kl_growth")))
    return checks


def outcome(checks: list[Check], **parts) -> GateOutcome:
    """The verdict: pass only when no check failed or stayed inconclusive under fail-closed."""
    failed = any(c.status in (FAIL, INCONCLUSIVE) for c in checks)
    return GateOutcome(passed=not failed, checks=checks, **parts)
