"""The request log's writer: one JSON line per generation request (kvfleet.contract.REQUEST_LOG_FIELDS), held
briefly and written together."""

from __future__ import annotations

import asyncio
import logging
from typing import IO

log = logging.getLogger(__name__)

# Lines are written together, at most this long after the first of them and never more than REQUEST_LOG_MAX_LINES at
# once: stdout is unbuffered in the image (EMF lines must leave at once), and a write per request was a quarter of
# the agent's CPU per request.
REQUEST_LOG_FLUSH_S = 0.25
REQUEST_LOG_MAX_LINES = 512


class RequestLog:
    def __init__(self, stdout: IO[str]) -> None:
        self.stdout = stdout
        self._lines: list[str] = []  # lines not yet written
        self._flush: asyncio.TimerHandle | None = None

    def add(self, line: str) -> None:
        """Holds one line (ending in a newline) for the next write."""
        self._lines.append(line)
        if len(self._lines) >= REQUEST_LOG_MAX_LINES:
            self.flush()
        elif self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(REQUEST_LOG_FLUSH_S, self.flush)

    def flush(self) -> None:
        """Writes the lines held, in one write."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if not self._lines:
            return
        text, self._lines = "".join(self._lines), []
        try:
            self.stdout.write(text)
            self.stdout.flush()
        except (OSError, ValueError) as err:  # stdout gone (a closed pipe): serving goes on without the log
            log.warning("request log lines lost: %s", err)
