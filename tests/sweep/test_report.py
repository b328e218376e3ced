"""The report's figures: the intermediate values' axis shows the range where trials are compared."""

from __future__ import annotations

import math
from pathlib import Path

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from sweep.report import STATE_COLOURS, _intermediate_values_by_state, focus_range, infeasible, judged, render_report


def _study(tmp_path: Path, curves: list[tuple[TrialState, list[float]]], direction: str = "minimize") -> optuna.Study:
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'r.db'}", direction=direction)
    for x, (state, curve) in enumerate(curves):
        values = dict(enumerate(curve))
        study.add_trial(create_trial(
            state=state, value=curve[-1] if state == TrialState.COMPLETE else None, params={"x": float(x)},
            distributions={"x": FloatDistribution(0, 100)}, intermediate_values=values))
    return study


CURVES = [  # every trial starts at chance (2.3); the ones that finished end between 0.05 and 0.15
    (TrialState.COMPLETE, [2.3, 0.4, 0.12, 0.05]),
    (TrialState.COMPLETE, [2.3, 0.6, 0.2, 0.15]),
    (TrialState.COMPLETE, [2.3, 0.5, 0.1, 0.08]),
    (TrialState.PRUNED, [2.3, 2.29]),
    (TrialState.PRUNED, [2.3, float("nan")]),
]


def test_the_axis_focuses_on_the_values_that_matter_and_keeps_the_full_range_a_click_away(tmp_path: Path) -> None:
    study = _study(tmp_path, CURVES)
    fig = _intermediate_values_by_state(study)
    low, high = fig.layout.yaxis.range
    assert 0.0 < low < 0.05 and 0.15 < high < 0.2  # the region 0.05 to 0.15 fills the plot
    buttons = {b.label: b.args[0] for b in fig.layout.updatemenus[0].buttons}
    assert buttons == {"focus": {"yaxis.range": [low, high]}, "full range": {"yaxis.autorange": True}}
    assert '"full range"' in render_report(study)


def test_every_trial_with_reports_is_drawn_in_its_state_s_colour_failed_ones_too(tmp_path: Path) -> None:
    # Optuna's plot leaves failed trials out: the title said red is failed, and no trace could ever be red (review).
    study = _study(tmp_path, [*CURVES, (TrialState.FAIL, [2.3, 1.1]), (TrialState.FAIL, [])])
    fig = _intermediate_values_by_state(study)
    drawn = {trace.name: (trace.line.color, list(trace.y)) for trace in fig.data}
    assert len(drawn) == 6  # every trial that reported, the failed one that reported nothing aside
    assert drawn["Trial5 (fail)"] == (STATE_COLOURS["FAIL"], [2.3, 1.1])
    assert drawn["Trial0 (complete)"][0] == STATE_COLOURS["COMPLETE"]


def test_maximised_metrics_focus_from_the_worst_finisher_up(tmp_path: Path) -> None:
    flipped = [(state, [1 - v for v in curve]) for state, curve in CURVES]
    focus = focus_range(_study(tmp_path, flipped, "maximize").get_trials(), maximize=True)
    assert focus is not None and 0.8 < focus[0] < 0.85 and 0.95 < focus[1] < 1.0


@pytest.mark.parametrize("curves", [
    [(TrialState.COMPLETE, [1.0, 0.98, 0.95]), (TrialState.COMPLETE, [1.0, 0.7, 0.1])],  # finals span the range
    [(TrialState.PRUNED, [math.nan])],  # nothing finite
    [(TrialState.COMPLETE, [0.5, 0.5])],  # one value
])
def test_no_focus_where_it_would_hide_nothing(tmp_path: Path, curves: list[tuple[TrialState, list[float]]]) -> None:
    study = _study(tmp_path, curves)
    assert focus_range(study.get_trials(), maximize=False) is None
    assert _intermediate_values_by_state(study).layout.updatemenus == ()


def test_text_that_would_not_show_as_itself_is_written_as_its_escape(tmp_path: Path) -> None:
    """A description or a failure reason holding an escape sequence or a right-to-left override reached the page raw
    (HTML-escaped only): the override reorders what follows it as shown, so a reason could read as another."""
    from sweep.outcomes import ATTR_FAIL, SPEC_ATTR

    study = _study(tmp_path, CURVES)
    study.set_user_attr(SPEC_ATTR, {"description": "two lines\nand a bell\a, an escape\x1b[2J, <b>\u202eevil",
                                    "metric": "val_loss"})
    study.add_trial(create_trial(state=TrialState.FAIL, params={"x": 9.0},
                                 distributions={"x": FloatDistribution(0, 100)},
                                 user_attrs={ATTR_FAIL: "ValueError: gnp\u202eexe.txt"}))
    page = render_report(study)
    assert not any(c in page for c in "\a\x1b\u202e")
    assert "two lines\nand a bell\\x07, an escape\\x1b[2J, &lt;b&gt;\\u202eevil" in page
    assert "ValueError: gnp\\u202eexe.txt" in page


def test_the_infeasible_share_counts_each_config_once_among_the_finished_trials(tmp_path: Path) -> None:
    # Edits review: "3 of 11 trials (27%)" counted a lost trial and its retry, an interrupted one and its waiting
    # retry as feasible trials, where the failures left them out: 3 of 9 is the share.
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'r.db'}")
    rows = [(TrialState.COMPLETE, {}), (TrialState.FAIL, {"fail_reason": "boom"}),  # 0, 1: judged
            (TrialState.FAIL, {"fail_reason": "worker lost"}), (TrialState.COMPLETE, {"retry_of": 2}),  # 2 retried
            (TrialState.FAIL, {"interrupted": True}), (TrialState.WAITING, {"retry_of": 4}),  # 4 and its retry
            (TrialState.PRUNED, {"prune_reason": {"rule": "nan"}}), (TrialState.RUNNING, {})]
    for state, attrs in rows:
        study.add_trial(create_trial(state=state, value=1.0 if state == TrialState.COMPLETE else None,
                                     params={"x": 1.0}, distributions={"x": FloatDistribution(0, 2)},
                                     user_attrs=attrs))
    trials = study.get_trials()
    bad, _ = infeasible(trials)
    assert [t.number for t in bad] == [1, 6]
    assert [t.number for t in judged(trials)] == [0, 1, 3, 6]
