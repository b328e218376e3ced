"""`sweep report`: one self-contained HTML file to share a study: optimisation history, every trial's intermediate
values coloured by state, parameter importances, the infeasible trials and why, the best config, and a warning when
the best value sits on the edge of the search space. The figures are Optuna's own (plotly), with plotly.js inlined
once so the file opens anywhere, offline."""

from __future__ import annotations

import contextlib
import html
import math
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import optuna
import yaml
from optuna.trial import FrozenTrial, TrialState

from sweep.confirm import confirmation_rows, is_warm, lineage_label, warm_starts
from sweep.outcomes import (
    ATTR_CONFIG,
    ATTR_FAIL,
    ATTR_PRUNE,
    ATTR_RETRY_OF,
    ATTR_WARM_START,
    LOST_REASON,
    SPEC_ATTR,
    Outcome,
    budget_counts,
    outcome_of,
    retried_numbers,
)
from sweep.results import (
    best_trial,
    confirm_count,
    made_by_sweep,
    no_best_line,
    ran_by_sweep,
    retraining,
    state_counts,
    steps_trained,
    trials_per_hour,
)
from sweep.urls import mask_urls
from trainer.fast_fail_rules import DIVERGED
from trainer.yaml_file import printable

__all__ = ["edge_warnings", "focus_range", "infeasible", "render_report"]

STATE_COLOURS = {"COMPLETE": "#2a9d8f", "PRUNED": "#e9a23b", "FAIL": "#d62828", "RUNNING": "#577590"}
INFEASIBLE_RULES = DIVERGED


def _html(text: str) -> str:
    """`text` for the page: HTML-escaped, and each character that would not show as itself written as its escape
    (`\\x1b`, `\\u202e`), as the terminal's lines write them (`printable`); line breaks and tabs kept."""
    return html.escape(printable(text, keep="\t\n\r"))


def infeasible(trials: list[FrozenTrial]) -> tuple[list[FrozenTrial], Counter[str]]:
    """Trials that diverged (pruned for NaN/Inf/explosion) or failed, and how many for each reason. A trial that was
    retried (its worker was lost or interrupted, or a storage error) is not: its retry stands for its config."""
    bad: list[FrozenTrial] = []
    reasons: Counter[str] = Counter()
    retried = retried_numbers(trials)
    for trial in trials:
        prune = trial.user_attrs.get(ATTR_PRUNE)
        prune = prune if isinstance(prune, dict) else {}  # another tool's attr of that name is not sweep's
        if trial.state == TrialState.FAIL and not trial.user_attrs.get("interrupted") and trial.number not in retried:
            bad.append(trial)
            # No reason: one sweep's worker lost, or another tool's failure (`outcome_of`), which gave none
            unsaid = LOST_REASON if outcome_of(trial) == Outcome.LOST else "failed, no reason given"
            reasons[str(trial.user_attrs.get(ATTR_FAIL, unsaid))] += 1
        elif trial.state == TrialState.PRUNED and prune.get("rule") in INFEASIBLE_RULES:
            bad.append(trial)
            reasons[f"diverged: {prune['rule']}"] += 1
    return bad, reasons


def judged(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    """The trials `infeasible` chooses among: the finished ones that stand for their config (not one that was
    retried or interrupted, whose retry stands for it; not one still waiting or running)."""
    retried = retried_numbers(trials)
    return [t for t in trials if t.state.is_finished() and t.number not in retried
            and not t.user_attrs.get("interrupted")]


def edge_warnings(space: dict[str, Any], params: dict[str, Any], margin: float = 0.05) -> list[str]:
    """A best value within `margin` of a range's end (on the log scale for log ranges) suggests the optimum lies
    outside the space searched: widen the range."""
    warnings = []
    for key, dist in space.items():
        if dist.get("type") not in ("float", "int") or key not in params:
            continue
        low, high, value = float(dist["low"]), float(dist["high"]), float(params[key])
        if high <= low:
            continue
        scale = math.log if dist.get("log") else (lambda x: x)
        position = (scale(value) - scale(low)) / (scale(high) - scale(low))
        if position <= margin:
            warnings.append(f"{key} = {value:.4g} is at the low edge of [{low:.4g}, {high:.4g}]: consider lowering "
                            "`low`")
        elif position >= 1 - margin:
            warnings.append(f"{key} = {value:.4g} is at the high edge of [{low:.4g}, {high:.4g}]: consider raising "
                            "`high`")
    return warnings


def _figure(fig: Any, first: bool) -> str:
    return fig.to_html(full_html=False, include_plotlyjs="inline" if first else False)


def focus_range(trials: list[FrozenTrial], maximize: bool) -> tuple[float, float] | None:
    """The part of the intermediate values' axis that matters: from the best value any trial reached to the worst
    final value of a completed trial (a trial's last value while none has completed), with a margin. The first
    evaluations (a loss of 2.3 at step 0) and trials that never learned stretch the axis over a range where the
    comparison is not; they stay one "full range" click away. None when the focus would show nearly everything."""
    values = [v for t in trials for v in t.intermediate_values.values() if math.isfinite(v)]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    ends = [t.intermediate_values[max(t.intermediate_values)] for t in (complete or trials) if t.intermediate_values]
    ends = [v for v in ends if math.isfinite(v)]
    if not values or not ends:
        return None
    full_low, full_high = min(values), max(values)
    low, high = (min(ends), full_high) if maximize else (full_low, max(ends))
    if full_high <= full_low or (high - low) >= 0.8 * (full_high - full_low):
        return None
    margin = 0.08 * (high - low) if high > low else 0.05 * max(abs(low), 1e-12)
    return low - margin, high + margin


def _history(study: optuna.Study, trials: list[FrozenTrial], confirm: int) -> Any:
    """Optuna's optimisation history, its best-so-far line drawn from the trials the study's best is chosen from
    (`sweep.results.best_trial`): with `warm_start.confirm` on, those trained cold; in a study sweep made, those it
    ran (a trial added from outside, `Study.add_trial`, is passed over). Drawn from every complete trial, it would end
    on a value that the report's best trial, `sweep status` and `sweep best` all pass over."""
    fig = optuna.visualization.plot_optimization_history(study)
    counted = [t for t in trials if ran_by_sweep(t)] if made_by_sweep(study) else trials
    if confirm <= 0 and len(counted) == len(trials):
        return fig
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    best_of = {t.number: float(t.value) for t in counted
               if t.state == TrialState.COMPLETE and t.value is not None and not (confirm > 0 and is_warm(t))}
    for trace in fig.data:
        if trace.name != "Best Value" or trace.x is None:
            continue
        best: float | None = None
        line: list[float | None] = []
        for number in trace.x:
            value = best_of.get(int(number))
            if value is not None and not math.isnan(value) and (
                    best is None or (value > best if maximize else value < best)):
                best = value
            line.append(best)
        trace.y = line
        if confirm > 0:
            trace.name = "Best Value (trained cold)"
    return fig


@contextlib.contextmanager
def _optuna_quiet() -> Iterator[None]:
    """Optuna's warnings while the report is drawn ("There are no complete trials", "Study instance does not contain
    completed trials") stay out of the output: each figure that cannot be drawn yet says so in the report."""
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(level)


def _intermediate_values_by_state(study: optuna.Study) -> Any:
    with _optuna_quiet():  # a study with no reports: its plot says so, not a log line
        fig = optuna.visualization.plot_intermediate_values(study)
    states = {t.number: t.state.name for t in study.get_trials(deepcopy=False)}
    for trace in fig.data:
        match = re.search(r"(\d+)", trace.name or "")
        if match:
            state = states.get(int(match.group(1)), "RUNNING")
            trace.update(line={"color": STATE_COLOURS.get(state, "#888")}, legendgroup=state,
                         name=f"{trace.name} ({state.lower()})", opacity=0.8)
    # Optuna draws complete, pruned and running trials only: a failed one's values (reported before it diverged, was
    # lost or raised) would be missing from a plot whose title says red is failed (review).
    import plotly.graph_objects as go

    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,)):
        if trial.intermediate_values:
            steps = sorted(trial.intermediate_values)
            fig.add_trace(go.Scatter(x=steps, y=[trial.intermediate_values[s] for s in steps],
                                     mode="lines+markers", name=f"Trial{trial.number} (fail)", legendgroup="FAIL",
                                     line={"color": STATE_COLOURS.get("FAIL", "#888")}, opacity=0.8))
    fig.update_layout(title="Intermediate values (green: complete, orange: pruned, red: failed)")
    focus = focus_range(study.get_trials(deepcopy=False), study.direction == optuna.study.StudyDirection.MAXIMIZE)
    if focus is not None:
        fig.update_layout(yaxis={"range": list(focus), "autorange": False}, updatemenus=[{
            "type": "buttons", "direction": "right", "x": 1.0, "xanchor": "right", "y": 1.12, "yanchor": "bottom",
            "showactive": True, "buttons": [
                {"label": "focus", "method": "relayout", "args": [{"yaxis.range": list(focus)}]},
                {"label": "full range", "method": "relayout", "args": [{"yaxis.autorange": True}]}]}])
    return fig


def _warm_row(trial: FrozenTrial) -> str:
    parent = trial.user_attrs[ATTR_WARM_START]
    value = "" if trial.value is None else f"{trial.value:.6g}"
    cells = [f"#{trial.number}", f"#{parent.get('trial')} of {parent.get('study')}", str(parent.get("step")),
             f"{float(parent.get('distance', math.nan)):.3f}", f"{float(parent.get('value', math.nan)):.6g}", value,
             trial.state.name.lower()]
    return "<tr>" + "".join(f"<td>{_html(cell)}</td>" for cell in cells) + "</tr>"


def _warm_start_section(trials: list[FrozenTrial]) -> str:
    """Which trials started from which neighbour, how far away, and what they made of it; and the compute saved."""
    warm = [t for t in trials if is_warm(t)]
    if not warm:
        return ""
    trained = steps_trained(trials)
    starts = warm_starts(trials)  # one per lineage, as `sweep status` counts them
    configs = sum(t.user_attrs.get(ATTR_RETRY_OF) is None for t in trials)
    inherited = sum(int(t.user_attrs[ATTR_WARM_START].get("step", 0)) for t in starts)
    rows = "".join(_warm_row(t) for t in warm)
    confirmed = confirmation_rows(trials)
    confirmations = "".join(
        "<tr>" + "".join(f"<td>{_html(cell)}</td>" for cell in (
            f"#{r['warm']}", "" if r["warm_value"] is None else f"{r['warm_value']:.6g}", f"#{r['cold']}",
            r["cold_state"], "" if r["cold_value"] is None else f"{r['cold_value']:.6g}")) + "</tr>"
        for r in confirmed)
    confirmation_html = (
        "<h3>Confirmed cold</h3><p>Each warm trial below was trained again from its own config, from scratch "
        "(<code>warm_start.confirm</code>); the study's best is the best cold value.</p><table><tr><th>warm trial"
        f"</th><th>warm value</th><th>cold trial</th><th>state</th><th>cold value</th></tr>{confirmations}</table>"
        if confirmed else "<p class='note'>No warm trial was confirmed cold: set <code>warm_start.confirm: K"
        "</code> to retrain the best K at the end of the study.</p>")
    return (f"<h2>Warm start</h2><p>{len(starts)} of {configs} trials started from a neighbour's checkpoint "
            f"(a retry counted with the trial it retries), "
            f"inheriting {inherited} steps; the study trained {trained} steps itself. A warm trial's value belongs to "
            "its lineage (the donor's config trained the steps before the handoff, its own the rest), not to its "
            "config alone.</p><table><tr><th>trial</th>"
            "<th>donor</th><th>from step</th><th>distance</th><th>donor value</th><th>final value</th>"
            f"<th>state</th></tr>{rows}</table>{confirmation_html}")


def render_report(study: optuna.Study) -> str:
    with _optuna_quiet():
        return _render(study)


def _render(study: optuna.Study) -> str:
    trials = study.get_trials(deepcopy=False)
    spec = study.user_attrs.get(SPEC_ATTR, {})
    used, _ = budget_counts(trials)
    bad, reasons = infeasible(trials)
    sections: list[str] = []
    first = True

    def add_figure(title: str, build: Any) -> None:
        nonlocal first
        try:
            fig = build()
        except Exception as exc:  # noqa: BLE001 - a figure Optuna cannot draw yet must not lose the report
            sections.append(f"<h2>{title}</h2><p class='note'>Not available: {_html(str(exc))}</p>")
            return
        sections.append(f"<h2>{title}</h2>{_figure(fig, first)}")
        first = False

    add_figure("Optimisation history", lambda: _history(study, trials, confirm_count(study)))
    add_figure("Intermediate values", lambda: _intermediate_values_by_state(study))
    add_figure("Parameter importances", lambda: optuna.visualization.plot_param_importances(study))

    # Out of the trials that could be (edits review: retried, interrupted and waiting ones were counted as feasible)
    counted = len(judged(trials))
    share = 100 * len(bad) / counted if counted else 0.0
    # A failure reason may quote a storage error, and that the storage URL: never its password.
    rows = "".join(f"<tr><td>{_html(mask_urls(reason))}</td><td>{count}</td></tr>" for reason, count in
                   reasons.most_common())
    sections.append(f"<h2>Infeasible trials</h2><p>{len(bad)} of {counted} finished trials ({share:.0f}%) "
                    "diverged or failed (a retried trial counts once, as its retry).</p>"
                    + (f"<table><tr><th>reason</th><th>trials</th></tr>{rows}</table>" if rows else ""))

    sections.append(_warm_start_section(trials))

    best = best_trial(study)
    if best is None:
        sections.append(f"<h2>Best trial</h2><p>{_html(no_best_line(study).capitalize())}.</p>")
    else:
        warnings = edge_warnings(spec.get("space", {}), best.params)
        warning_html = "".join(f"<p class='warning'>&#9888; {_html(w)}</p>" for w in warnings)
        stored = best.user_attrs.get(ATTR_CONFIG, best.params)
        builtin = spec.get("loop") is None and spec.get("command") is None
        again_with = retraining(best, stored) if builtin and isinstance(stored, dict) else None
        config = mask_urls(yaml.safe_dump(stored if again_with is None else again_with.config, sort_keys=False))
        lineage = lineage_label(best, trials)
        if is_warm(best):
            warning_html += f"<p class='warning'>&#9888; {_html(lineage)}</p>"
        elif lineage:
            warning_html += f"<p class='note'>{_html(lineage)}</p>"
        if spec.get("loop") is not None:  # the user's own config: `python -m trainer` does not run it
            again = (f"Its config, as <code>{_html(str(spec['loop']))}(config, run)</code> received it; "
                     f"<code>sweep reproduce STUDY {best.number}</code> runs it again:")
        elif spec.get("command") is not None:
            again = (f"Its config, as the command received it; <code>sweep reproduce STUDY {best.number}</code> runs "
                     "it again:")
        elif ATTR_CONFIG not in best.user_attrs:  # another tool's trial: its params, and nothing sweep can rerun
            again = "Its params (a trial sweep did not run: no config of its own is recorded):"
        else:
            env, notes = ("", "") if again_with is None else (again_with.env, again_with.comment)
            notes = "".join(f"<br>{_html(line.removeprefix('# '))}" for line in notes.splitlines())
            again = (f"Its full config; <code>{_html(env)}python -m trainer best.yaml</code> trains it "
                     f"again:{notes}")
        sections.append(f"<h2>Best trial: #{best.number}, {_html(str(spec.get('metric', 'value')))} = "
                        f"{best.value:.6g}</h2>{warning_html}<p>{again}</p><pre>{_html(config)}</pre>")

    counts = ", ".join(f"{k} {v}" for k, v in state_counts(study).items())
    rate = trials_per_hour(trials)
    throughput = "" if rate is None else f"; {rate:.0f} trials per hour"
    budget = (f"{used}/{spec['n_trials']} trials used" if "n_trials" in spec else
              f"{used} trials (no budget: a study sweep did not create)")
    head = (f"<h1>Study {_html(printable(study.study_name))}</h1>"
            f"<p>{_html(spec.get('description', ''))}</p>"
            f"<p>{study.direction.name.lower()} {_html(str(spec.get('metric', '')))}; "
            f"{budget}; {counts}{throughput}.</p>")
    style = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px}"
             ".warning{color:#9a3412;font-weight:600}.note{color:#666}pre{background:#f5f5f5;padding:1em}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>sweep report: "
            f"{_html(printable(study.study_name))}</title><style>{style}</style></head><body>{head}"
            + "".join(sections) + "</body></html>")
