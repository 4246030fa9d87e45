"""HTTP client of the reward service (`python -m dapo_megatron.reward.serve`), used by
`RewardManager` when `reward.service_url` is set. Stdlib only: the trainer gains no dependency."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import fields
from typing import Sequence

from dapo_megatron.reward.math_score import MAX_RESPONSE_CHARS, RewardResult
from dapo_megatron.reward.scorers import scorers_for

_RESULT_FIELDS = {f.name for f in fields(RewardResult)}


class RewardClient:
    """`score_batch` over HTTP; same results as a local `RewardPool`.

    `request_timeout_s` bounds each socket wait, i.e. the whole server-side batch: the server
    answers once every pair is scored or past its own deadline.
    """

    def __init__(self, url: str, request_timeout_s: float = 600.0):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward.service_url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.request_timeout_s = request_timeout_s

    def score_batch(self, responses: list[str], ground_truths: list[str],
                    data_sources: Sequence[str] | None = None) -> list[RewardResult]:
        if len(responses) != len(ground_truths):
            raise ValueError(f"score_batch: {len(responses)} responses but {len(ground_truths)} "
                             "ground truths")
        # The math reward reads only the tail; cutting here keeps megabyte responses off the wire.
        # A scorer that reads the start too (geo3k's <think> format) gets the whole response.
        scorers = scorers_for(data_sources, len(responses))
        body = {"responses": [r if s.whole_response else r[-MAX_RESPONSE_CHARS:]
                              for r, s in zip(responses, scorers)],
                "ground_truths": [str(g) for g in ground_truths]}
        if data_sources is not None:  # left out when unset: a server that predates it still answers
            body["data_sources"] = list(data_sources)
        reply = self._request("/score", body)
        results = [RewardResult(**{k: v for k, v in r.items() if k in _RESULT_FIELDS})
                   for r in reply["results"]]
        if len(results) != len(responses):
            raise RuntimeError(f"reward service at {self.url} (reward.service_url) returned "
                               f"{len(results)} results for {len(responses)} responses")
        return results

    def health(self) -> dict:
        return self._request("/health", None)

    def _request(self, path: str, body: dict | None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.request_timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise RuntimeError(f"reward service at {self.url} (reward.service_url) answered "
                               f"{e.code} on {path}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            raise RuntimeError(f"reward service at {self.url} (reward.service_url) unreachable: "
                               f"{e}; start it with `python -m dapo_megatron.reward.serve`") from None

    def close(self) -> None:
        """Nothing to release (one connection per request); here so backends share an API."""
