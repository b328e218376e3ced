"""The report and the dashboard as a person sees them: rendered by a headless Chromium, scripts and all.

Skipped where no Chromium is installed (`apt-get install chromium`; `.ci/run` installs it when it can)."""

from __future__ import annotations

import copy
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import optuna
import pytest

from tests.conftest import TINY_STUDY, sweep_cli, write_study

CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(name)), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium installed")


def rendered(url: str) -> str:
    """The page's DOM after its scripts ran (plotly drawing, the dashboard's React app fetching its API)."""
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=20000",
                           "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture(scope="module")
def warm_study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("browser")
    document = copy.deepcopy(TINY_STUDY) | {"name": "seen", "n_trials": 4, "warm_start": {"max_distance": 5.0}}
    document["fixed"] = {**document["fixed"], "max_steps": 40, "model": {"hidden": 16}}
    document["space"] = {"learning_rate": document["space"]["learning_rate"]}
    path = write_study(folder, document)
    assert sweep_cli("run", path).returncode == 0
    return path


def test_the_report_renders_every_figure(warm_study: Path) -> None:
    report = warm_study.with_name("report.html")
    assert sweep_cli("report", warm_study, "-o", report).returncode == 0
    dom = rendered(report.as_uri())
    figures = report.read_text().count('class="plotly-graph-div"')
    assert figures >= 3
    assert dom.count("main-svg") >= figures  # plotly drew each one: the inlined script ran, offline
    assert "Best trial" in dom and "started from a neighbour" in dom  # the warm-start lineage table


def test_the_dashboard_shows_lineage_and_checkpoint_artifacts(warm_study: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "sweep.cli", "dashboard", str(warm_study), "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5).close()
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None
                time.sleep(0.3)
        study = optuna.load_study(study_name="seen", storage=f"sqlite:///{warm_study.with_name('seen.db')}")
        warm = [t for t in study.get_trials() if "warm_start_from" in t.user_attrs]
        assert warm
        dom = rendered(f"http://127.0.0.1:{port}/dashboard/studies/1/trials?numbers={warm[-1].number}")
        assert f"Trial {warm[-1].number}" in dom
        assert "warm_start_from" in dom  # the lineage, on the trial's page
        assert f"trial{warm[-1].number:05d}-step" in dom  # its checkpoint, listed as a downloadable artifact
    finally:
        server.terminate()
        server.wait(timeout=30)
