"""A uvicorn server on a port of 127.0.0.1, run in a thread of the test process: for the tests that
need the server's service object at hand (a process-level server is ``test_server.Server``)."""

from __future__ import annotations

import threading
import time

import uvicorn


class ThreadedUvicorn:
    """``app`` served on 127.0.0.1:``port`` until :meth:`stop`; ``server.config.loaded_app`` is the
    app as uvicorn wrapped it."""

    def __init__(self, app, port: int) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.server.started, "uvicorn did not start in 30 s"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()
