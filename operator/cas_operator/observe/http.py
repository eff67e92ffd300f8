"""The operator's one HTTP client: small requests with a hard timeout (urllib; the loops run
in threads). Metrics sources and the router client (`routers.py`) use it."""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request


class FetchError(Exception):
    """The request failed: refused, timed out, non-2xx, or unreadable; message says which,
    `status` the HTTP status when there was an answer."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def get(url: str, params: dict[str, str] | None, timeout: float, max_bytes: int) -> bytes:
    """GET `url?params`; raises FetchError for every failure (`timeout` bounds each socket wait)."""
    if params:
        url = f"{url}?{urllib.parse.urlencode(params)}"
    return _fetch(urllib.request.Request(url), timeout, max_bytes)


def post_form(url: str, params: dict[str, str], timeout: float, max_bytes: int) -> bytes:
    """POST `params` form-encoded (for queries too long for a URL: proxies in front of
    Prometheus often cap request lines at 8 KiB); errors as `get`."""
    body = urllib.parse.urlencode(params).encode()
    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    return _fetch(request, timeout, max_bytes)


def request(
    method: str,
    url: str,
    timeout: float,
    max_bytes: int,
    headers: dict[str, str] | None = None,
) -> bytes:
    """A body-less `method` request (GET, DELETE); errors as `get`."""
    return _fetch(
        urllib.request.Request(url, method=method, headers=headers or {}), timeout, max_bytes
    )


def _fetch(request: urllib.request.Request, timeout: float, max_bytes: int) -> bytes:
    where = request.full_url.split("?")[0]
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            body: bytes = resp.read(max_bytes + 1)
    except urllib.error.HTTPError as exc:
        detail = exc.read(300).decode("utf-8", errors="replace").strip()
        raise FetchError(f"HTTP {exc.code} from {where}: {detail}", exc.code) from exc
    except urllib.error.URLError as exc:
        raise FetchError(f"{where}: {exc.reason}") from exc
    except (TimeoutError, OSError) as exc:
        raise FetchError(f"{where}: {exc or type(exc).__name__}") from exc
    if len(body) > max_bytes:
        raise FetchError(f"{where}: answer larger than {max_bytes} bytes")
    return body
