"""The e2e load's client (`e2e.traffic.recorded`): which connection errors it sends once more.

Regression guarded: a router that retires closes its kept-alive connections; when the close
lands as the client writes its next request, aiohttp raises ClientOSError "Can not write request
body" (seen once in test_keys_rotation: one failed request of 250 while the old router left).
The OpenAI SDK retries such connection errors; the load did only for ServerDisconnectedError,
so the test failed on a request no server had read. A refused connect is no such close."""

from __future__ import annotations

import aiohttp

from e2e.traffic.recorded import closed_unanswered


def test_a_connection_closed_as_the_request_is_written_is_sent_once_more() -> None:
    exc = aiohttp.ClientOSError(None, "Can not write request body for http://10.0.0.1/v1/x")
    assert closed_unanswered(exc)
    assert closed_unanswered(aiohttp.ServerDisconnectedError())


def test_a_refused_or_reset_connection_is_a_failure() -> None:
    assert not closed_unanswered(aiohttp.ClientOSError(111, "Connection refused"))
    assert not closed_unanswered(aiohttp.ClientOSError(104, "Connection reset by peer"))
    assert not closed_unanswered(aiohttp.ClientPayloadError("Response payload is not completed"))
