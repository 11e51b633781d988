"""The notebooks in JupyterLab, in a real browser, as a student sees them.

JupyterLab starts as the container starts it (``docker/start-jupyter.sh``, bound to 127.0.0.1, a token), on a
copy of ``notebooks/`` with small settings in the parameter cell. Headless Chromium (Debian's ``chromium``,
driven by Playwright with ``executable_path``: Playwright's own browser download is never used) opens
``single.ipynb``, then ``main.ipynb`` and ``worker.ipynb`` in two tabs, runs all cells from the Run menu and
reads the page: every rank's progress widget drawn (not "Error displaying widget" or a text fallback), bars of
one length, the results table and the figures, no error output, no output line wrapped mid-word; then the
Stop button in ``main.ipynb`` and the worker tab's message. papermill runs the same notebooks headless in
test_notebooks.py; this is what it cannot see (the widgets in a real front end, the page's layout).

Screenshots of the train and results cells go to pytest's temporary folder (``screenshots*``; run with
``--basetemp DIR`` to keep them in DIR).
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.procs import REPO, base_env, free_port, stop

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine: apt-get install chromium "
                                 "(the README's install step for the tests)")]

# What a student would type for a quick try; the worker tab must still be training when Stop is pressed.
SINGLE = {"EPOCHS": 2, "MAX_STEPS": 0, "BATCH_SIZE": 32, "WORKERS": 0, "WANDB_MODE": "disabled",
          "TENSORBOARD": False}
# The two tabs load as ImageNet does on the GPU nodes, by two DataLoader workers: Jupyter's Stop signals the kernel's
# whole process group, workers included (what a terminal's Ctrl-C does; tests/test_real_processes.py).
DDP = {**SINGLE, "EPOCHS": 3, "BACKEND": "gloo", "INIT_TIMEOUT": 120, "WORKERS": 2, "LOADER": "workers"}
WIDTH = 1280   # a laptop's browser window, JupyterLab's file browser open beside the notebook
RUN_BOUND_MS = 240_000
# Chromium as root in a container, with no network beyond loopback (its background connections only fail).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]


def set_parameters(notebook: Path, values: dict) -> None:
    """Change the parameter cell's values in place, as a student edits them (the comments stay)."""
    nb = json.loads(notebook.read_text())
    cell = next(c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
    source = "".join(cell["source"])
    for name, value in values.items():
        source, found = re.subn(rf"^{name} = [^#\n]*?(\s*#|$)", rf"{name} = {value!r}\1", source, flags=re.M)
        assert found == 1, f"{notebook.name} has no parameter {name}"
    cell["source"] = source.splitlines(keepends=True)
    notebook.write_text(json.dumps(nb, indent=1) + "\n")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on a copy of the kit's notebooks, started by docker/start-jupyter.sh; its URL, token, folder and
    the server's pid."""
    kit = tmp_path_factory.mktemp("kit")
    shutil.copytree(Path(REPO) / "notebooks", kit / "notebooks")
    set_parameters(kit / "notebooks" / "single.ipynb", SINGLE)
    ddp = {**DDP, "MASTER_PORT": free_port()}
    for name in ("main", "worker"):
        set_parameters(kit / "notebooks" / f"{name}.ipynb", ddp)
    port, token = free_port(), "browser-test-token"
    log = open(kit / "jupyter.log", "w")
    env = base_env(PORT=port, JUPYTER_IP="127.0.0.1", JUPYTER_TOKEN=token, KIT_DIR=kit)
    server = subprocess.Popen(["bash", str(Path(REPO) / "docker" / "start-jupyter.sh")], env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, (kit / "jupyter.log").read_text()
                time.sleep(0.5)
        yield url, token, kit, server.pid
    finally:
        stop_server(server, url, token)
        log.close()


def stop_server(server: subprocess.Popen, url: str, token: str) -> None:
    """Shut the kernels down through the server, then end the server and anything it started (its kernels
    run in sessions of their own, so the server's process group alone would miss them)."""
    import psutil
    try:
        started = psutil.Process(server.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        started = []
    try:
        kernels = json.load(urllib.request.urlopen(f"{url}/api/kernels?token={token}", timeout=5))
        for k in kernels:
            urllib.request.urlopen(urllib.request.Request(f"{url}/api/kernels/{k['id']}?token={token}",
                                                          method="DELETE"), timeout=10)
    except OSError:
        pass
    stop([server])
    for p in started:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def kernel_children(lab) -> dict:
    """Each notebook kernel the server started (pid) and the processes it has started: (pid, status) pairs."""
    import psutil
    found = {}
    for kernel in psutil.Process(lab[3]).children(recursive=True):
        try:
            if "ipykernel" in " ".join(kernel.cmdline()) and "ipykernel" not in " ".join(kernel.parent().cmdline()):
                found[kernel.pid] = [(c.pid, c.status()) for c in kernel.children()]
        except psutil.Error:   # a process that ended meanwhile
            pass
    return found


@pytest.fixture(scope="module")
def browser(lab):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    return tmp_path_factory.mktemp("screenshots")


# -- driving JupyterLab -------------------------------------------------------------------------
def open_notebook(browser, lab, name: str):
    """A new tab (its own JupyterLab workspace) with notebooks/NAME.ipynb open and its kernel ready."""
    url, token, *_ = lab
    page = browser.new_page(viewport={"width": WIDTH, "height": 900})
    page.goto(f"{url}/lab/workspaces/{name}/tree/notebooks/{name}.ipynb?token={token}")
    deadline, idle_since = time.monotonic() + 90, None
    while True:   # ready: the kernel idle for a second, no dialog open
        if take_proposed_kernel(page):
            idle_since = None
        elif page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").count():
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since > 1:
                return page
        assert time.monotonic() < deadline, f"{name}.ipynb: no kernel after 90 s"
        page.wait_for_timeout(200)


def take_proposed_kernel(page) -> bool:
    """JupyterLab sometimes asks for the kernel although the notebook names it, also after its kernel was idle
    (seen under load): take the one proposed. Whether there was such a question."""
    dialog = page.locator(".jp-Dialog")
    if not dialog.count():
        return False
    assert "Select Kernel" in dialog.first.text_content(), dialog.first.text_content()
    dialog.get_by_role("button", name="Select", exact=True).click()
    return True


def run_all(page) -> None:
    """Run > Run All Cells, then wait until the cells are queued. On a loaded machine (the suite runs on both cores)
    a click can land before the menu is ready and nothing starts: then the menu is used again, but never once a cell
    is queued or has run (that would run the notebook twice)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    for attempt in range(3):
        take_proposed_kernel(page)
        try:
            page.locator(".lm-MenuBar-itemLabel", has_text=re.compile("^Run$")).click(timeout=15_000)
            page.locator(".lm-Menu-item:not(.lm-mod-disabled) .lm-Menu-itemLabel",
                         has_text=re.compile("^Run All Cells$")).click(timeout=15_000)
        except PlaywrightTimeout:   # the kernel question came up in between: answer it, then use the menu again
            if attempt == 2:
                raise
            if not take_proposed_kernel(page):
                page.keyboard.press("Escape")   # a menu left open
            continue
        try:
            page.wait_for_function("() => {" + PROMPTS + "return prompts.some(p => /[*0-9]/.test(p)); }",
                                   timeout=30_000)
            return
        except PlaywrightTimeout:
            if attempt == 2:
                raise
            page.keyboard.press("Escape")   # a menu left open


PROMPTS = "const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(e => e.textContent);"


def wait_until_done(page, timeout_ms: int = RUN_BOUND_MS) -> list[str]:
    """Wait until no cell is running or queued; the code cells' prompts (``[3]:`` ran, ``[ ]:`` did not)."""
    wait_js(page, "() => {" + PROMPTS + "return !prompts.some(p => p.includes('*')); }", None, timeout_ms,
            "every cell to finish")
    return page.evaluate("() => {" + PROMPTS + "return prompts; }")


def wait_for_output(page, words: str, timeout_ms: int) -> None:
    """Wait until a cell's output shows ``words`` (widgets' padding read as spaces)."""
    wait_js(page, """words => [...document.querySelectorAll('.jp-OutputArea-output')].some(
        e => e.textContent.replace(/[\\u00a0\\u2007]/g, ' ').includes(words))""", words, timeout_ms,
            f"an output showing {words!r}")


def wait_js(page, js: str, arg, timeout_ms: int, what: str) -> None:
    """Wait until ``js`` is true, in slices, answering a kernel question JupyterLab may ask meanwhile (seen under
    load); at the bound, fail with what the page shows (prompts, kernel state, dialog, the last output), so that a
    run that stopped in CI says where."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
        take_proposed_kernel(page)
        try:
            page.wait_for_function(js, arg=arg, timeout=max(1, min(5.0, deadline - time.monotonic())) * 1000)
            return
        except PlaywrightTimeout:
            if time.monotonic() >= deadline:
                raise AssertionError(f"{page.url}: no {what} within {timeout_ms / 1000:.0f} s.\n"
                                     + page_state(page)) from None


def page_state(page) -> str:
    """The notebook's state in a few lines, for a failure message."""
    prompts = page.evaluate("() => {" + PROMPTS + "return prompts; }")
    status = page.locator(".jp-Notebook-ExecutionIndicator").first
    dialog = page.locator(".jp-Dialog")
    return (f"prompts: {prompts}\nkernel: "
            f"{status.get_attribute('data-status') if status.count() else 'no indicator'}\n"
            f"dialog: {dialog.first.text_content() if dialog.count() else 'none'}\n"
            f"the page's last output:\n{text(page)[-2500:]}")


def text(page) -> str:
    return re.sub("[\xa0\u2007]", " ", page.locator(".jp-Notebook").text_content())   # tqdm pads with U+2007


def errors(page) -> list[str]:
    """Every red (stderr or error) output on the page."""
    return [e.text_content()[-1500:] for e in
            page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").all()]


def bar_widths(page) -> list[float]:
    return [round(b.bounding_box()["width"]) for b in page.locator(".jp-OutputArea-output .widget-hprogress").all()]


# Output lines the browser wrapped: JupyterLab breaks long output lines anywhere, mid-word ("pe" / "r rank").
WRAPPED_LINES = """() => {
  const wrapped = [];
  for (const pre of document.querySelectorAll('.jp-OutputArea-output pre')) {
    const lines = pre.textContent.replace(/\\n$/, '').split('\\n');
    const lineHeight = parseFloat(getComputedStyle(pre).lineHeight);
    const rows = Math.round(pre.getBoundingClientRect().height / lineHeight);
    if (rows > lines.length) wrapped.push(...lines.filter(l => l.length > 80));
  }
  return wrapped;
}"""


def shoot(page, shots: Path, name: str, cell_text: str, end: bool = False) -> None:
    """The cell that holds ``cell_text``; with ``end``, the window at the end of its output (a traceback)."""
    page.add_style_tag(content=".Toastify { display: none; }")   # JupyterLab's "get Jupyter news?" over the cells
    cell = page.locator(".jp-CodeCell", has_text=cell_text).first
    if end:
        cell.locator(".jp-OutputArea-output").last.evaluate("e => e.scrollIntoView({block: 'end'})")
        page.screenshot(path=str(shots / f"{name}.png"))
    else:
        cell.scroll_into_view_if_needed()
        cell.screenshot(path=str(shots / f"{name}.png"))


def assert_ran_cleanly(page, name: str, prompts: list[str]) -> None:
    assert not errors(page), f"{name}: error output on the page:\n" + "\n---\n".join(errors(page))
    assert all(re.search(r"\d", p) for p in prompts), f"{name}: not every cell ran: {prompts}"
    shown = text(page)
    for fallback in ("Error displaying widget", "HBox(children", "IProgress not found", "FloatProgress("):
        assert fallback not in shown, f"{name}: the progress widget fell back to text ({fallback!r})"
    assert page.evaluate(WRAPPED_LINES) == [], f"{name}: output lines wrapped at {WIDTH} px"


def assert_results_shown(page, name: str) -> None:
    tables = page.locator(".jp-RenderedMarkdown table", has_text="Acc@1")
    assert tables.count() == 1, f"{name}: no results table"
    assert page.locator(".jp-OutputArea-output img").count() == 2, f"{name}: the curves and the time split"


# -- the tests ----------------------------------------------------------------------------------
def test_single_notebook_runs_in_jupyterlab_with_its_progress_widgets_table_and_figures(lab, browser, shots):
    page = open_notebook(browser, lab, "single")
    run_all(page)
    prompts = wait_until_done(page)
    shoot(page, shots, "single-train", "fit(job)")
    shoot(page, shots, "single-results", "results_table(run_dirs)")
    assert_ran_cleanly(page, "single", prompts)
    assert len(bar_widths(page)) == SINGLE["EPOCHS"], "one progress widget per epoch"
    assert len(set(bar_widths(page))) == 1, f"the bars' lengths differ: {bar_widths(page)}"
    assert "epoch 2/2" in text(page)
    assert_results_shown(page, "single")
    page.close()


@pytest.fixture(scope="module")
def tabs(lab, browser):
    """main.ipynb and worker.ipynb open side by side, in two tabs."""
    return {name: open_notebook(browser, lab, name) for name in ("main", "worker")}


def test_main_and_worker_in_two_tabs_each_show_their_ranks_progress_and_the_same_results(tabs, shots):
    main, worker = tabs["main"], tabs["worker"]
    run_all(main)     # rank 0 first: it waits in its join cell for the worker
    run_all(worker)
    prompts = {name: wait_until_done(page) for name, page in tabs.items()}
    for name, page in tabs.items():
        shoot(page, shots, f"{name}-train", "fit(job)")
        shoot(page, shots, f"{name}-results", "results_table(")
        assert_ran_cleanly(page, name, prompts[name])
    for rank, page in enumerate((main, worker)):
        widths = bar_widths(page)
        assert len(widths) == DDP["EPOCHS"] and len(set(widths)) == 1, widths
        for epoch in range(1, DDP["EPOCHS"] + 1):
            assert f"rank {rank} epoch {epoch}/{DDP['EPOCHS']}" in text(page)   # each rank its own bar
    assert_results_shown(main, "main")
    assert worker.locator(".jp-RenderedMarkdown table", has_text="Acc@1").count() == 1   # the same global table

    def epoch_lines(page):
        return re.findall(r"epoch \d/\d: train loss [^|]*\| val loss [\d. a-z]*", text(page))
    assert len(epoch_lines(main)) == DDP["EPOCHS"] and epoch_lines(main) == epoch_lines(worker)


def test_stop_in_main_tells_the_worker_tab_why_its_training_stopped(tabs, lab, shots):
    main, worker = tabs["main"], tabs["worker"]
    run_all(main)
    run_all(worker)
    wait_for_output(worker, "rank 1 epoch 1/", RUN_BOUND_MS)   # the worker is training
    deadline = time.monotonic() + 30
    while sum(bool(kids) for kids in kernel_children(lab).values()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sum(bool(kids) for kids in kernel_children(lab).values()) == 2, "both kernels train with loader workers"
    main.locator("[data-command='notebook:interrupt-kernel']").first.click()   # the toolbar's Stop button
    stopped = time.monotonic()
    wait_for_output(worker, "training stopped because rank 0 stopped", 60_000)
    waited = time.monotonic() - stopped
    wait_until_done(main, 60_000)
    wait_until_done(worker, 60_000)
    shoot(main, shots, "main-stopped", "fit(job)", end=True)
    shoot(worker, shots, "worker-stopped", "fit(job)", end=True)
    assert waited < 30, f"the worker heard of the Stop after {waited:.0f} s"
    said = text(worker)
    assert "rank 1: training stopped because rank 0 stopped: KeyboardInterrupt" in said, said[-3000:]
    assert "--resume" in said or "RESUME" in said, "the worker's message says how to continue"
    assert "KeyboardInterrupt" in text(main)
    # Stop signalled main's kernel's process group, workers included; both kernels live on, their workers are gone
    deadline = time.monotonic() + 15
    while any(kernel_children(lab).values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(kernel_children(lab).values()), f"a kernel kept processes after Stop: {kernel_children(lab)}"
