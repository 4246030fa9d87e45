"""The reward service on 127.0.0.1 (ephemeral port) in a thread, for the tests that talk HTTP to it."""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from dapo_megatron.reward.pool import RewardPool
from dapo_megatron.reward.serve import make_server


@contextlib.contextmanager
def serving(pool: RewardPool) -> Iterator[str]:
    """Yields the service's URL; shuts it down after, and checks its thread ended."""
    server = make_server(pool, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    assert not thread.is_alive()
