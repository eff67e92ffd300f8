"""One small HTTP GET with a hard timeout (urllib; the operator's timer runs in a thread)."""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request


class FetchError(Exception):
    """The request failed: refused, timed out, non-2xx, or unreadable; message says which."""


def get(url: str, params: dict[str, str] | None, timeout: float, max_bytes: int) -> bytes:
    """GET `url?params`; raises FetchError for every failure (`timeout` bounds each socket wait)."""
    if params:
        url = f"{url}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body: bytes = resp.read(max_bytes + 1)
    except urllib.error.HTTPError as exc:
        detail = exc.read(300).decode("utf-8", errors="replace").strip()
        raise FetchError(f"HTTP {exc.code} from {url.split('?')[0]}: {detail}") from exc
    except urllib.error.URLError as exc:
        raise FetchError(f"{url.split('?')[0]}: {exc.reason}") from exc
    except (TimeoutError, OSError) as exc:
        raise FetchError(f"{url.split('?')[0]}: {exc or type(exc).__name__}") from exc
    if len(body) > max_bytes:
        raise FetchError(f"{url.split('?')[0]}: answer larger than {max_bytes} bytes")
    return body
