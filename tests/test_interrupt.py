"""Ctrl-C in a terminal during ``python -m niah reproduce``: one line on stderr, rc 130, no kernel left running."""

import os
import signal
import subprocess
import sys
import time

import pytest

from niah.config import ROOT

# `niah reproduce --config smoke` with its run and figures folders under the test's tmp_path (the CLI has no option
# for them), so that an existing papermill_runs/smoke/ is never touched; and with Ctrl-C's handler as in a terminal:
# a test run started as a shell's background job (`nohup ... &`, as CI scripts are) inherits SIGINT ignored, and the
# interrupt below would be ignored with it
DRIVER = """
import functools, pathlib, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
import niah.report.chain
root = pathlib.Path(sys.argv[1])
niah.report.chain.reproduce = functools.partial(
    niah.report.chain.reproduce, run_root=root / "runs", figures_root=root / "figs"
)
from niah.__main__ import main
sys.exit(main(["reproduce", "--config", "smoke"]))
"""


def _kernels_of(tmp_path) -> list[str]:
    """The running kernels started by the driver below: their connection files are in its temporary folder."""
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [line for line in ps.splitlines() if "ipykernel" in line and str(tmp_path) in line]


@pytest.mark.slow
def test_ctrl_c_mid_notebook_prints_one_line_and_leaves_no_kernel(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # where jupyter_client writes a kernel's connection file
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tmp_path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a process group of its own, which the Ctrl-C below goes to, as a terminal's does
    )
    try:
        for line in driver.stdout:
            if "] 01_" in line:  # notebook 00 done, 01 starting: its kernel starts, then runs a cell that takes seconds
                break
        else:
            pytest.fail(f"the chain ended before notebook 01: {driver.communicate()[1][-3000:]}")
        time.sleep(4)
        assert _kernels_of(tmp_path), "no kernel of notebook 01 is running: the interrupt would not test its stop"
        os.killpg(driver.pid, signal.SIGINT)
        _, err = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert driver.returncode == 130, err[-3000:]
    assert "niah: interrupted. Every row written so far is kept" in err
    # ipykernel's ZMQError and nbclient's DeadKernelError came with tracebacks, the kernel's interrupt with a line
    for symptom in ("Traceback", "Kernel died", "KeyboardInterrupt"):
        assert symptom not in err, err[-3000:]
    assert not _kernels_of(tmp_path)  # at once: a kernel's own poller would stop it a second or more after the driver
