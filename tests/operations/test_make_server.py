"""`make server` tells a server that died from one still starting: it waits on the process's state, and says
"exited", with the server's log, as soon as the process is gone (a taken port), not after its 180 s. And it knows
its running server whatever the terminal's width."""
import http.server
import os
import subprocess
import sys
import threading

import pytest

from helpers.prefect_stack import ROOT
from helpers.servers import free_port


@pytest.mark.slow  # a Prefect server's start, about 10 s on two cores
def test_a_server_that_cannot_start_is_reported_exited_with_its_log(tmp_path):
    taken = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=taken.serve_forever, daemon=True).start()
    try:
        home = tmp_path / "prefect-home"
        done = subprocess.run(["make", "-s", f"PREFECT_PORT={taken.server_port}", f"PREFECT_HOME={home}", "server"],
                              cwd=ROOT, env={**os.environ, "PREFECT_HOME": str(home)}, capture_output=True, text=True,
                              timeout=240)
    finally:
        taken.shutdown()
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "prefect server exited:" in output and "not ready after" not in output, output
    assert f"port {taken.server_port}" in output  # the server's own last words, from its log


def test_a_running_server_is_found_behind_a_long_path_in_a_narrow_terminal(tmp_path):
    """The pid file's process is recognised by its command line, which ps cuts to COLUMNS unless told not to: a venv
    deep in a fresh clone put "prefect server start" past column 80, and a second `make server` started another."""
    home = tmp_path / "prefect-home"
    home.mkdir()
    deep = tmp_path / ("venv-" + "x" * 100) / "bin" / "prefect"
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", str(deep), "server", "start"],
                              start_new_session=True)  # stands for the server: the words ps is asked for, far right
    threading.Thread(target=server.wait, daemon=True).start()  # reaped once ended, as init reaps a real server
    (home / "server.pid").write_text(f"{server.pid}\n")
    try:
        done = subprocess.run(["make", "-s", f"PREFECT_HOME={home}", "server-stop"], cwd=ROOT,
                              env={**os.environ, "COLUMNS": "80"}, capture_output=True, text=True, timeout=60)
        assert done.stdout.strip() == f"prefect server stopped (pid {server.pid})", done.stdout + done.stderr
        assert server.wait(timeout=30) is not None and not (home / "server.pid").exists()
    finally:
        server.kill()
        server.wait()
