"""`make server` tells a server that died from one still starting: it waits on the process's state, and says
"exited", with the server's log, as soon as the process is gone (a taken port), not after its 180 s."""
import http.server
import os
import subprocess
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
