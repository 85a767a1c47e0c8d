"""Write the gate's report: report.json (everything), report.md (for a reviewer), report.html (plots)."""

from __future__ import annotations

import base64
import html
import io
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from engine.atomic_write import write_text_atomic
from evals import stats
from evals.drift import BOOTSTRAP_BLOCK_TOKENS, LayerDrift, TaskComparison
from evals.gate import GateOutcome
from evals.verdict import describe_setting

# Published SmolLM2-135M (base) figures, normalized accuracy, shown beside ours for orientation only.
PUBLISHED_SMOLLM2_135M = {"driftgate_hellaswag": 0.421, "driftgate_piqa": 0.684, "arc_average": 0.439}


def _pts(x: float) -> str:
    return f"{100 * x:+.2f}"


def comparison_row(c: TaskComparison, floor: TaskComparison | None) -> dict[str, Any]:
    t = c.table
    return {
        "task": c.task, "metric": c.metric, "n": t.num_items,
        "baseline_acc": t.baseline_accuracy, "candidate_acc": t.candidate_accuracy, "delta": t.delta,
        "delta_interval": list(c.delta_interval), "bootstrap_interval": list(c.bootstrap_interval),
        "drop_upper_bound": c.drop_upper_bound, "mcnemar_p": c.mcnemar_p,
        "right_to_wrong": t.num_right_to_wrong, "wrong_to_right": t.num_wrong_to_right,
        "flip_rate": t.flip_rate, "noise_floor_flip_rate": floor.table.flip_rate if floor else None,
        "confident_items": c.num_confident_items, "confident_flips": c.num_confident_flips,
        "choice_kl_mean": c.choice_kl_mean, "choice_kl_p95": c.choice_kl_p95,
        "answer_change_rate": c.answer_change_rate, "min_detectable_drop": c.min_detectable_drop,
        "invalid_rate": [c.baseline_invalid_rate, c.candidate_invalid_rate],
        "max_tokens_rate": [c.baseline_max_tokens_rate, c.candidate_max_tokens_rate],
    }


def build_report(outcome: GateOutcome, manifest: dict[str, Any], items: dict[str, Any]) -> dict[str, Any]:
    """The JSON report: verdict, checks, every metric, per-item outcomes, and the manifest."""
    rows = [comparison_row(c, outcome.noise_floor.get(name)) for name, c in outcome.comparisons.items()]
    return {
        "verdict": "pass" if outcome.passed else "fail",
        "checks": [{**asdict(c), "marginal": c.marginal} for c in outcome.checks],
        "tier1": {
            "tasks": rows,
            "pooled": comparison_row(outcome.pooled, outcome.noise_pooled) if outcome.pooled else None,
            "worst_flips": {name: [asdict(f) for f in c.worst_flips] for name, c in outcome.comparisons.items()},
        },
        "tier0": asdict(outcome.parity) if outcome.parity else None,
        "tier2": asdict(outcome.agreement) if outcome.agreement else None,
        "tier2_divergences": [asdict(d) for d in outcome.divergences],
        "tier2_expected_answers": comparison_row(outcome.answers, None) if outcome.answers else None,
        "tier2_accuracy_by_length": {task: [asdict(b) for b in buckets]
                                     for task, buckets in outcome.length_accuracy.items()},
        "items": items,
        "manifest": manifest,
    }


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _interval(check: dict[str, Any]) -> str:
    interval = check.get("interval")
    return "" if interval is None else f"[{interval[0]:.4g}, {interval[1]:.4g}]"


def render_markdown(report: dict[str, Any]) -> str:
    failed = [c for c in report["checks"] if c["status"] in ("fail", "inconclusive")]
    verdict = report["verdict"].upper()
    reason = "; ".join(f"{c['name']}: {c['detail']}" for c in failed[:3])
    tier0_failed = any(c["name"].startswith("tier0.") for c in failed)
    if tier0_failed and (layers := _layer_drift(report)) is not None and layers.largest_step_layer is not None:
        reason += (f"; hidden-state drift enters mostly at decoder layer {layers.largest_step_layer} "
                   f"(model.layers.{layers.largest_step_layer})")
    out = [f"# Gate verdict: **{verdict}**" + (f" — {reason}" if reason else ""), ""]
    if (manifest := report["manifest"]).get("dtype"):  # None when the candidate was a live server
        out += [f"Candidate judged on {manifest['device']} with {describe_setting(manifest)}.", ""]
    one_sided = report["manifest"].get("policy", {}).get("confidence", 0.95)
    two_sided = f"{stats.two_sided_level(one_sided):.0%}"
    out += ["## Checks", _table(["check", "status", "value", f"{two_sided} interval", "threshold", "rule"], [
        [c["name"], c["status"].upper() + (" (marginal)" if c.get("marginal") else ""),
         "" if c["value"] is None else f"{c['value']:.4g}", _interval(c),
         "" if c["threshold"] is None else f"{c['threshold']:.4g}", c["detail"]] for c in report["checks"]]), ""]
    if marginal := [c["name"] for c in report["checks"] if c.get("marginal")]:
        out += [f"Marginal: {', '.join(marginal)}. The threshold lies inside the value's two-sided {two_sided} "
                f"interval (Tier 0: a bootstrap over runs of {BOOTSTRAP_BLOCK_TOKENS} positions; Tier 2: over prompts; "
                "Tier 1's flip rates: Wilson's, the noise floor's rate taken as measured), so its one-sided "
                f"{one_sided:.0%} bound, the one Tier 1's endpoints are held to, is on the other side: the verdict on "
                "it rests on which text was scored, and other text, or another machine's rounding, can flip it. "
                "Score more (the policy's tier0.num_documents, tier2.num_prompts) to settle it.", ""]
    t1 = report["tier1"]
    rows = t1["tasks"] + ([t1["pooled"]] if t1["pooled"] else [])
    out += [f"## Tier 1: paired task results (points; {one_sided:.0%} one-sided bound via the two-sided {two_sided} "
            "interval)",
            _table(["task", "n", "baseline", "candidate", "delta", "CI (Newcombe)", "CI (bootstrap)", "McNemar p",
                    "R->W / W->R", "flip %", "floor flip %", "confident flips", "choice KL mean/p95", "MDE"], [
                [r["task"], str(r["n"]), f"{100 * r['baseline_acc']:.2f}", f"{100 * r['candidate_acc']:.2f}",
                 _pts(r["delta"]), f"[{_pts(r['delta_interval'][0])}, {_pts(r['delta_interval'][1])}]",
                 f"[{_pts(r['bootstrap_interval'][0])}, {_pts(r['bootstrap_interval'][1])}]", f"{r['mcnemar_p']:.3g}",
                 f"{r['right_to_wrong']} / {r['wrong_to_right']}", f"{100 * r['flip_rate']:.2f}",
                 "" if r["noise_floor_flip_rate"] is None else f"{100 * r['noise_floor_flip_rate']:.2f}",
                 f"{r['confident_flips']}/{r['confident_items']}",
                 "" if r["choice_kl_mean"] is None else f"{r['choice_kl_mean']:.4f} / {r['choice_kl_p95']:.4f}",
                 f"{100 * r['min_detectable_drop']:.2f}"] for r in rows]), ""]
    if t1["pooled"]:
        p = t1["pooled"]
        alpha = 1 - _confidence(report)
        out += [f"Power: this run resolves a pooled drop of {100 * p['min_detectable_drop']:.2f} pts "
                f"(80% power, one-sided {100 * alpha:g}%) at the observed flip rate {100 * p['flip_rate']:.2f}%.", ""]
    out += _prefix_cache_block(report)
    out += _published_block(report)
    if report["tier0"]:
        out += ["## Tier 0: logit parity by token position",
                _table(["positions", "tokens", "KL mean", "KL p99", "top-1 agree", "dNLL mean"], [
                    [name, str(s["num_tokens"]), f"{s['kl_mean']:.5f}", f"{s['kl_p99']:.5f}",
                     f"{s['top1_agreement']:.4f}", f"{s['nll_delta_mean']:+.5f}"]
                    for name, s in [("all", report["tier0"]["overall"]), *report["tier0"]["by_position"].items()]]), ""]
        out += _layer_block(report)
    if report["tier2"]:
        a = report["tier2"]
        source = (report["manifest"].get("tier2_prompts") or {}).get("source")
        out += ["## Tier 2: greedy long generations" + (f" (prompts: {source})" if source else ""),
                f"{a['num_identical']}/{a['num_prompts']} identical; mean agreed prefix {a['mean_agreed_prefix']:.1f} "
                f"tokens (min {a['min_agreed_prefix']}); divergence positions: {list(a['divergence_positions'])}", ""]
        for d in report.get("tier2_divergences", []):
            out.append(f"- prompt {d['prompt_index']} (...{d['prompt_tail']!r}) parts after {d['position']} tokens, "
                       f"at ...{d['agreed']!r}: baseline {d['baseline_next']!r}, candidate {d['candidate_next']!r}")
        out += [""] if report.get("tier2_divergences") else []
    if answers := report.get("tier2_expected_answers"):
        out += ["### Expected answers on your prompts",
                f"{answers['n']} prompts say what a right answer contains: baseline right on "
                f"{100 * answers['baseline_acc']:.1f}%, candidate {100 * answers['candidate_acc']:.1f}% "
                f"({answers['right_to_wrong']} right -> wrong, {answers['wrong_to_right']} wrong -> right); "
                f"upper bound of the drop {100 * answers['drop_upper_bound']:.2f} pts", ""]
    for task, buckets in report.get("tier2_accuracy_by_length", {}).items():
        out += [f"### {task}: accuracy by the baseline's generation length (characters)",
                _table(["length", "items", "baseline", "candidate", "delta"], [
                    [f"{b['min_chars']}–{b['max_chars']}", str(b["num_items"]), f"{100 * b['baseline_accuracy']:.1f}",
                     f"{100 * b['candidate_accuracy']:.1f}",
                     f"{100 * (b['candidate_accuracy'] - b['baseline_accuracy']):+.1f}"] for b in buckets]), ""]
    out += ["## Worst right -> wrong flips (highest baseline confidence first)"]
    for task, flips in t1["worst_flips"].items():
        for f in flips[:20]:
            margin = "" if f["baseline_margin"] is None else f" margin {f['baseline_margin']:.3f}"
            out.append(f"- {task} doc {f['doc_id']}:{margin}; baseline answered {f['baseline_answer']!r}, "
                       f"candidate {f['candidate_answer']!r}")
            if f["candidate_response"]:
                out.append(f"  - baseline: {f['baseline_response'][:300]!r}\n  - candidate: {f['candidate_response'][:300]!r}")
    m = report["manifest"]
    out += ["", "## Manifest", "```json", json.dumps(m, indent=2, sort_keys=True, default=str), "```", ""]
    return "\n".join(out)


def _layer_drift(report: dict[str, Any]) -> LayerDrift | None:
    raw = (report.get("tier0") or {}).get("by_layer")
    return LayerDrift(relative_drift=tuple(raw["relative_drift"]), largest_step_layer=raw["largest_step_layer"]) \
        if raw else None


def _layer_block(report: dict[str, Any]) -> list[str]:
    """Per-layer hidden-state drift: the layer that adds the most is where to look first."""
    layers = _layer_drift(report)
    if layers is None:
        return []
    if layers.largest_step_layer is None:
        return ["Hidden-state drift by decoder layer: none (the candidate's hidden states equal the baseline's).", ""]
    top = sorted(range(len(layers.steps)), key=lambda i: -layers.steps[i])[:3]
    return [f"Hidden-state drift by decoder layer (mean |h_candidate - h_baseline| / |h_baseline| after the layer). "
            f"Largest step at layer {layers.largest_step_layer}; top steps: "
            + ", ".join(f"layer {i} {layers.steps[i]:+.4f}" for i in top) + ".",
            _table(["layer", "drift", "step"], [[str(i), f"{d:.5f}", f"{st:+.5f}"] for i, (d, st) in
                                                enumerate(zip(layers.relative_drift, layers.steps, strict=True))]),
            ""]


def _prefix_cache_block(report: dict[str, Any]) -> list[str]:
    arms = report["manifest"].get("prefix_cache") or {}
    parts = [f"{name} {a['prefill_tokens_saved']} of {a['task_prompt_tokens']} "
             f"({100 * a['prefill_tokens_saved'] / a['task_prompt_tokens']:.0f}%)"
             for name, a in arms.items() if a["task_prompt_tokens"]]
    return [f"Prefill tokens saved by the prefix cache while scoring tasks (choices share their item's context): "
            f"{'; '.join(parts)}.", ""] if parts else []


def _confidence(report: dict[str, Any]) -> float:
    """The policy's one-sided confidence (a report built without a policy, in tests: the default's)."""
    return report["manifest"].get("policy", {}).get("confidence", 0.95)


def _published_block(report: dict[str, Any]) -> list[str]:
    scores = report["manifest"].get("baseline_scores", {})
    ours = {t: s.get("acc_norm,none") for t, s in scores.items() if "acc_norm,none" in s}
    arc = [ours[t] for t in ("driftgate_arc_easy", "driftgate_arc_challenge") if t in ours]
    if arc and len(arc) == 2:
        ours["arc_average"] = sum(arc) / 2
    shown = [k for k in PUBLISHED_SMOLLM2_135M if k in ours]
    if not shown:
        return []
    return ["Baseline beside SmolLM2-135M's published (base model) normalized accuracy, for orientation only:",
            _table(["task", "ours (baseline)", "published"],
                   [[k, f"{100 * ours[k]:.1f}", f"{100 * PUBLISHED_SMOLLM2_135M[k]:.1f}"] for k in shown]), ""]


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def render_html(report: dict[str, Any], markdown: str) -> str:
    """The Markdown as preformatted text plus three plots embedded as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images = []
    t1 = report["tier1"]
    rows = t1["tasks"] + ([t1["pooled"]] if t1["pooled"] else [])
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.5 * len(rows)))
    for y, r in enumerate(rows):
        lo, hi = r["delta_interval"]
        ax.errorbar(100 * r["delta"], y, xerr=[[100 * (r["delta"] - lo)], [100 * (hi - r["delta"])]], fmt="o", capsize=4)
    ax.axvline(0, color="grey", lw=1)
    ax.set_yticks(range(len(rows)), [r["task"] for r in rows])
    level = stats.two_sided_level(_confidence(report))
    ax.set_xlabel(f"accuracy delta, candidate - baseline (points, {100 * level:g}% two-sided CI)")
    images.append(("Per-task delta", _png(fig)))
    plt.close(fig)
    if report["tier0"]:
        buckets = report["tier0"]["by_position"]
        fig, ax = plt.subplots(figsize=(7, 3))
        names = list(buckets)
        ax.plot(names, [buckets[n]["kl_mean"] for n in names], "o-", label="KL mean")
        ax.plot(names, [buckets[n]["kl_p99"] for n in names], "s-", label="KL p99")
        ax.set_xlabel("token position")
        ax.set_ylabel("KL(baseline || candidate), nats")
        ax.legend()
        images.append(("KL by position", _png(fig)))
        plt.close(fig)
    if (layers := _layer_drift(report)) is not None:
        fig, ax = plt.subplots(figsize=(7, 3))
        index = list(range(len(layers.relative_drift)))
        ax.bar(index, layers.steps, color="tab:red", alpha=0.6, label="drift added by the layer")
        ax.plot(index, layers.relative_drift, "o-", label="drift after the layer")
        ax.set_xlabel("decoder layer")
        ax.set_ylabel("|h_cand - h_base| / |h_base|")
        ax.legend()
        images.append(("Hidden-state drift by layer", _png(fig)))
        plt.close(fig)
    if report["tier2"]:
        fig, ax = plt.subplots(figsize=(7, 3))
        positions = report["tier2"]["divergence_positions"]
        ax.hist(positions or [0], bins=20, color="tab:orange" if positions else "white")
        ax.set_xlabel("first divergent generated token")
        ax.set_ylabel("prompts")
        images.append(("Greedy divergence positions", _png(fig)))
        plt.close(fig)
    body = "".join(f"<h2>{html.escape(title)}</h2><img src='data:image/png;base64,{data}'/>" for title, data in images)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>driftgate report</title></head><body>"
            f"<h1>Gate verdict: {report['verdict'].upper()}</h1>{body}<pre>{html.escape(markdown)}</pre></body></html>")


def render_junit(report: dict[str, Any]) -> str:
    """The checks as a JUnit XML test suite, the report CI systems (GitLab, Jenkins, GitHub
    Actions' test reporters) display: a failing or inconclusive check is a failure, a skipped
    one skipped, the rest pass (a warning's detail goes to its output)."""
    checks = report["checks"]
    failing = [c for c in checks if c["status"] in ("fail", "inconclusive")]
    suite = ElementTree.Element("testsuite", name="driftgate.gate", tests=str(len(checks)),
                                failures=str(len(failing)),
                                skipped=str(sum(c["status"] == "skipped" for c in checks)))
    for check in checks:
        case = ElementTree.SubElement(suite, "testcase", classname="driftgate.gate", name=check["name"])
        if check in failing:
            failure = ElementTree.SubElement(case, "failure", message=f"{check['status']}: {check['detail']}")
            failure.text = f"value {check['value']} against threshold {check['threshold']}{_marginal_note(check)}"
        elif check["status"] == "skipped":
            ElementTree.SubElement(case, "skipped", message=check["detail"])
        else:
            ElementTree.SubElement(case, "system-out").text = (f"{check['status']}: {check['detail']}"
                                                               f"{_marginal_note(check)}")
    return ElementTree.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"


def _marginal_note(check: dict[str, Any]) -> str:
    return f"; marginal: interval {_interval(check)} holds the threshold" if check.get("marginal") else ""


def write_reports(report: dict[str, Any], report_dir: Path) -> dict[str, Path]:
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    markdown = render_markdown(report)
    paths = {"json": report_dir / "report.json", "md": report_dir / "report.md", "html": report_dir / "report.html",
             "junit": report_dir / "report.junit.xml"}
    for kind, text in (("json", json.dumps(report, indent=1, default=str)), ("md", markdown),
                       ("html", render_html(report, markdown)), ("junit", render_junit(report))):
        write_text_atomic(paths[kind], text)
    return paths
