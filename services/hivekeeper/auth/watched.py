"""A small file whose current content counts, as a mounted Secret or ConfigMap (Kubernetes swaps
it in place on an update)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable, Generic, TypeVar

T = TypeVar("T")
log = logging.getLogger("hivekeeper.auth")


class WatchedFile(Generic[T]):
    """`value` is `parse(text)` of the file as it is now, or `missing` while there is none. The
    file is read on every access (it is small and read rarely) and parsed again when it changed:
    comparing content misses no edit, where a modification time may not move."""

    def __init__(self, path: str | Path, parse: Callable[[str], T], missing: T):
        self.path = Path(path)
        self._parse, self._missing = parse, missing
        self._lock = threading.Lock()
        self._content: bytes | None = None
        self._value = missing

    @property
    def value(self) -> T:
        try:
            content = self.path.read_bytes()
        except FileNotFoundError:
            content = None
        with self._lock:
            if content != self._content:
                self._value = self._missing if content is None else self._parsed(content)
                self._content = content
            return self._value

    def _parsed(self, content: bytes) -> T:
        try:
            value = self._parse(content.decode())
        except ValueError as e:  # bad content: keep what we had (the next edit may fix it)
            log.warning("cannot read %s: %s", self.path, e)
            return self._value
        log.info("read %s", self.path)
        return value
