"""The Prefect UI as a user drives it: headless Chromium (Debian's `chromium`, .ci/services.sh installs it) through
playwright, on the CI server (.ci/services.sh) or any server in PREFECT_API_URL (`nightloom ui` starts one).

Opens the on-demand deployment, Run → Custom run, submits the form's default (the demo spec), waits for
Completed; then every task page of the run (the shard subflow's too) shows a log line of its own beyond
"Finished in state", and the run-summary artifact exists. Screenshots (the form, the run page, the
artifacts tab, the last page seen) are saved in the test's tmp folder (pytest's basetemp,
`test_default_run_from_the_form0/`) and, in CI, copied to `$SVC_DIR/ui-screenshots/` (`.ci-state/ui-screenshots/`).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from tests.support.ci import require_binary
from tests.support.prefect_server import client, deploy, wait_final

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.services
#: as root, in a container; and none of Chromium's own background traffic (updates, sync, Google lookups), which a
#: closed network refuses, many connections at a time, while the page is measured
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
#: how long a click, a page or an expected text may take: expect's own default (5 s) is not the page's, and a loaded
#: 2-core box drew the run form slower than that
WAIT_MS = 60_000


@pytest.fixture(scope="module")
def ui_url() -> str:
    return deploy().removesuffix("/").removesuffix("/api")


def task_runs_of(flow_run_id: str) -> list:
    """The run's task runs and its subflows' (not the placeholder task a subflow has in its parent)."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )

    with client() as c:
        subs = c.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
        )
        runs = c.read_task_runs(
            task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id, *(s.id for s in subs)]))
        )
    placeholders = {s.parent_task_run_id for s in subs}
    return [t for t in runs if t.id not in placeholders]


def own_lines(task_run_id) -> list[str]:
    """A task run's log lines other than Prefect's "Finished in state ..."."""
    from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId

    with client() as c:
        logs = c.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id])))
    return [x.message for x in logs if not x.message.startswith("Finished in state")]


def test_default_run_from_the_form(ui_url, tmp_path):
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import expect, sync_playwright
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    chromium = require_binary("chromium")
    with client() as c:
        deployment = c.read_deployment_by_name("training-pipeline/on-demand")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(WAIT_MS)  # clicks, navigation, waits; each expect below passes it too
        console: list[str] = []  # the UI's own errors, for the failure message
        page.on("console", lambda m: console.append(m.text) if m.type == "error" else None)
        page.on("response", lambda r: console.append(f"{r.status} {r.url}") if r.status >= 400 else None)
        try:
            page.goto(f"{ui_url}/deployments/deployment/{deployment.id}")
            page.get_by_role("button", name="Run", exact=True).click()
            page.get_by_text("Custom run", exact=True).click()
            page.wait_for_url(re.compile(rf"/deployments/deployment/{deployment.id}/run"))
            expect(page.get_by_text("heldout.<hash>.parquet", exact=False)).to_be_visible(
                timeout=WAIT_MS
            )  # not swallowed
            page.screenshot(path=tmp_path / "form.png", full_page=True)
            page.wait_for_load_state("networkidle")  # the form's schema and defaults are in (a quick click failed)
            try:
                created = submit(page)
            except PlaywrightError as e:
                raise AssertionError(f"Submit created no flow run ({e}); the UI's errors: {console}") from None
            assert created.status == 201, (created.status, created.text(), console)
            flow_run_id = created.json()["id"]
            page.goto(f"{ui_url}/runs/flow-run/{flow_run_id}")

            final = wait_final(flow_run_id, timeout=900, poll=2)
            page.reload()
            expect(page.get_by_text("Completed").first).to_be_visible(timeout=WAIT_MS)
            page.screenshot(path=tmp_path / "run.png", full_page=True)
            assert final.state.is_completed(), final.state.message

            tasks = task_runs_of(flow_run_id)
            assert len(tasks) >= 10, [t.name for t in tasks]  # shard tasks, gate, provision, plan, train, ...
            silent = []
            for t in tasks:
                lines = own_lines(t.id)
                if not lines:
                    silent.append(t.name)
                    continue
                page.goto(f"{ui_url}/runs/task-run/{t.id}")
                expect(page.get_by_text(lines[0][:60], exact=False).first).to_be_visible(timeout=WAIT_MS)
            assert not silent, f"task pages with no log line of their own: {silent}"

            with client() as c:
                arts = c.read_artifacts(
                    artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
                )
            assert "run-summary" in {a.key for a in arts}
            page.goto(f"{ui_url}/runs/flow-run/{flow_run_id}")
            page.get_by_text("Artifacts", exact=True).click()
            expect(page.get_by_text("run-summary", exact=True).first).to_be_visible(timeout=WAIT_MS)
            page.screenshot(path=tmp_path / "artifacts.png", full_page=True)
        finally:
            page.screenshot(path=tmp_path / "last.png", full_page=True)
            browser.close()
            keep_screenshots(tmp_path)


def submit(page, tries: int = 3):
    """Click the form's Submit as a user would, again after a 503: the server's answer to a write that met another
    (its SQLite: a stale read cannot take the write lock, SQLITE_BUSY at once, the busy timeout does not apply);
    nothing was written, and Prefect's own client retries exactly these. Seen once in CI under the services lane's
    load (20 `database is locked` in the server's log, from the worker's polls and heartbeats). Any other answer is
    returned as it came."""
    for attempt in range(tries):
        with page.expect_response(lambda r: r.url.endswith("/create_flow_run")) as created:
            page.get_by_role("button", name="Submit").click()
        if created.value.status != 503 or attempt == tries - 1:
            return created.value
        page.wait_for_timeout(2000 * (attempt + 1))


def keep_screenshots(folder: Path) -> None:
    """Copy the screenshots to $SVC_DIR/ui-screenshots (CI's state folder, .ci-state/), beside the services' logs."""
    svc = os.environ.get("SVC_DIR")
    if svc:
        dest = Path(svc) / "ui-screenshots"
        dest.mkdir(parents=True, exist_ok=True)
        for png in folder.glob("*.png"):
            shutil.copy2(png, dest / png.name)
