"""Reward service: a `RewardPool` behind a small JSON HTTP API, for when scoring should run on
other machines than the trainer (set `reward.service_url`).

    python -m dapo_megatron.reward.serve [--host 127.0.0.1] [--port 8000] [--workers 0] [--timeout-s 5]

POST /score  {"responses": [str], "ground_truths": [str], "data_sources"?: [str]}
             -> {"results": [{score, acc, pred, ...}]}   (no data_sources: the math reward for all)
GET  /health -> {"status": "ok", "num_workers", "timeout_s", "timeouts", "restarts", ...}

No authentication: it binds to 127.0.0.1 unless told otherwise; expose it only on a trusted network.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from dapo_megatron.reward.pool import RewardPool

logger = logging.getLogger(__name__)

# A 4096-response batch cut to 4000 characters each is ~16 MB of JSON; 256 MB leaves room and
# still refuses a runaway client before it is read into memory.
MAX_BODY_BYTES = 256 * 1024 * 1024


def make_server(pool: RewardPool, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """An HTTP server (not yet serving) that scores with `pool`; port 0 picks a free port,
    read it back from `server.server_address`."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path != "/health":
                return self._reply(404, {"error": f"unknown path {self.path}; use /health or /score"})
            self._reply(200, {"status": "ok", "num_workers": pool.num_workers,
                              "timeout_s": pool.timeout_s, **pool.stats()})

        def do_POST(self):
            if self.path != "/score":
                return self._reply(404, {"error": f"unknown path {self.path}; POST /score"})
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                return self._reply(413, {"error": f"body of {length} bytes > {MAX_BODY_BYTES}"})
            try:
                responses, ground_truths, data_sources = _parse_request(self.rfile.read(length))
            except ValueError as e:
                return self._reply(400, {"error": str(e)})
            results = pool.score_batch(responses, ground_truths, data_sources)
            self._reply(200, {"results": [dataclasses.asdict(r) for r in results]})

        def _reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt, *args):  # per-request lines would flood the trainer's logs
            logger.debug("%s " + fmt, self.address_string(), *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def _parse_request(raw: bytes) -> tuple[list[str], list[str], list[str] | None]:
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise ValueError("body must be an object with 'responses' and 'ground_truths'")
    responses, ground_truths = body.get("responses"), body.get("ground_truths")
    data_sources = body.get("data_sources")
    fields = [("responses", responses), ("ground_truths", ground_truths)]
    fields += [("data_sources", data_sources)] if data_sources is not None else []
    for name, value in fields:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"'{name}' must be a list of strings")
    for name, value in fields[1:]:
        if len(value) != len(responses):
            raise ValueError(f"{len(responses)} responses but {len(value)} {name}")
    return responses, ground_truths, data_sources


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dapo_megatron.reward.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    parser.add_argument("--workers", type=int, default=0, help="worker processes; 0: one per core")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="hard deadline per answer")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def stop(signum, frame):  # SIGTERM (docker stop, kill) shuts down like Ctrl-C
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)

    with RewardPool(args.workers, args.timeout_s) as pool:
        server = make_server(pool, args.host, args.port)
        host, port = server.server_address[:2]
        logger.info("reward service on http://%s:%d (%d workers, %.1f s deadline)", host, port,
                    pool.num_workers, pool.timeout_s)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()


if __name__ == "__main__":
    main()
