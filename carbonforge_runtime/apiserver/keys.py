"""The keys the API server accepts, and their limits, held in the API server process.

Two sources: the ``CF_API_KEY`` shortcut (its digest, from ``VLLM_API_KEY`` when it is the only key,
or from ``CF_API_KEY_SHA256`` beside a keys file) and the keys file ``CF_API_KEYS_FILE``
(:mod:`~carbonforge_runtime.core.api_keys`). The file is read when the server starts and again
whenever it changes: :meth:`KeyStore.refresh` compares the file's modification time, size and inode
(what a rename over it, an edit or a Kubernetes Secret update changes) and reads it only then. The
middleware calls it about once a second, in a daemon thread of its own (:func:`in_daemon_thread`), with
a deadline, so a read that hangs (a stalled network volume) never holds up the server's shutdown. A file that cannot be
read or is not a valid keys file leaves the last good keys in force; the reason goes to the log and
to the API server's ``/metrics`` (``carbonforge_api_keys_file_errors_total``,
``carbonforge_api_keys_file_valid``, ``carbonforge_api_keys_loaded``).

A presented secret is looked up by its SHA-256 digest in a dict and the digests compared with
:func:`hmac.compare_digest`; nothing here logs a secret or a digest.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from carbonforge_runtime.core.api_contract import MSG_EXPIRED_KEY, ApiError, auth_error
from carbonforge_runtime.core.api_keys import (
    KEYS_FILE_VARIABLE,
    SHORTCUT_DIGEST_VARIABLE,
    ApiKey,
    KeySet,
    KeysFileError,
    load_keys,
    shortcut_key,
)
from carbonforge_runtime.core.rate_limits import RequestBucket, Taken

log = logging.getLogger("carbonforge_runtime.apiserver.keys")
#: How often the file is looked at (its metadata only, unless it changed).
POLL_S = 1.0
#: The longest one look at the file (and a read when it changed) may take before it is given up.
REFRESH_DEADLINE_S = 10.0

def in_daemon_thread(call: Callable[[], bool]) -> asyncio.Future[bool]:
    """Run ``call`` in a new daemon thread; its result (or exception) on a future of the running loop.

    Unlike ``asyncio.to_thread``, the thread is not one of the loop's executor: closing the loop never
    waits for it, and a thread still running when the process exits does not keep it alive."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[bool] = loop.create_future()

    def settle(result: bool | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(bool(result))

    def run() -> None:
        result: bool | None = None
        error: BaseException | None = None
        try:
            result = call()
        except Exception as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits for this look
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="cf-keys-file", daemon=True).start()
    return future


_MISSING = auth_error(key_sent=False)
_INVALID = auth_error(key_sent=True)
_EXPIRED = auth_error(key_sent=True, message=MSG_EXPIRED_KEY)


class _Metrics:
    """The keys file's series on the API server's ``/metrics`` (prometheus_client's default registry,
    which vLLM's ``/metrics`` route serves), made once per process."""

    made: _Metrics | None = None

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge

        self.loaded = Gauge("carbonforge_api_keys_loaded", "Named API keys in force (from CF_API_KEYS_FILE)")
        self.valid = Gauge("carbonforge_api_keys_file_valid",
                           "1 when the last read of CF_API_KEYS_FILE was a valid keys file, 0 when the last "
                           "good keys are kept because it is not")
        self.errors = Counter("carbonforge_api_keys_file_errors",
                              "Reads of CF_API_KEYS_FILE that found it unreadable or invalid (the last good keys "
                              "stayed in force)")

    @classmethod
    def get(cls) -> _Metrics | None:
        if cls.made is None:
            try:
                cls.made = _Metrics()
            except (ImportError, ValueError):  # no prometheus_client, or names taken in this registry
                return None
        return cls.made


def _say_reloads() -> None:
    """The API server configures vLLM's logger only: give ours a line of its own in vllm.log."""
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [carbonforge keys] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


class KeyStore:
    """The accepted keys and the per-key limits' state."""

    def __init__(self, keys_file: str | None, shortcut_digest: bytes | None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.path = keys_file
        self.shortcut = shortcut_key(shortcut_digest) if shortcut_digest else None
        self.keys = KeySet()
        self.clock = clock
        self.wall = wall
        #: (mtime_ns, size, inode, device) of the file as last read; or the error text last reported.
        self.seen: tuple[int, int, int, int] | str | None = None
        self.buckets: dict[str, RequestBucket] = {}
        self.in_flight: dict[str, int] = {}
        self.metrics = _Metrics.get() if keys_file else None
        if keys_file:
            _say_reloads()
            self.refresh()

    @classmethod
    def from_environ(cls, environ: Any = None) -> KeyStore:
        env = os.environ if environ is None else environ
        path = env.get(KEYS_FILE_VARIABLE) or None
        shortcut: bytes | None = None
        hex_digest = env.get(SHORTCUT_DIGEST_VARIABLE)
        if hex_digest:
            try:
                shortcut = bytes.fromhex(hex_digest)
            except ValueError:
                shortcut = None
        elif env.get("VLLM_API_KEY"):
            shortcut = hashlib.sha256(env["VLLM_API_KEY"].encode("utf-8")).digest()
        return cls(path, shortcut)

    @property
    def required(self) -> bool:
        """Whether requests need a key (a key is set, or a keys file is named, even an empty one)."""
        return self.shortcut is not None or self.path is not None

    def refresh(self) -> bool:
        """Read the file again if it changed; True when a new set of keys is in force. Never raises: a
        file that cannot be used keeps the last good keys, and says why once per change."""
        if self.path is None:
            return False
        try:
            st = os.stat(self.path)
        except OSError as exc:
            self._failed(f"{KEYS_FILE_VARIABLE}={self.path}: cannot be read ({exc.strerror})")
            return False
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)
        if stamp == self.seen:
            return False
        try:
            keys = load_keys(self.path)
        except KeysFileError as exc:
            self._failed(exc.message + (f" (fix: {exc.remedy})" if exc.remedy else ""), stamp)
            return False
        first = self.seen is None
        self.keys = keys
        self.seen = stamp
        if self.metrics is not None:
            self.metrics.loaded.set(len(keys))
            self.metrics.valid.set(1)
        log.info("%s %s: %d named keys in force", "read" if first else "re-read, changed:", self.path, len(keys))
        return True

    def _failed(self, why: str, stamp: tuple[int, int, int, int] | None = None) -> None:
        if self.seen == (stamp or why):
            return
        self.seen = stamp or why
        kept = f"the last good keys stay in force ({len(self.keys)} named keys)"
        log.error("%s; %s", why, kept)
        if self.metrics is not None:
            self.metrics.errors.inc()
            self.metrics.valid.set(0)
            self.metrics.loaded.set(len(self.keys))

    def identify(self, authorization: bytes) -> ApiKey | ApiError:
        """The key an ``Authorization`` header's value holds, or the 401 to answer with."""
        if not authorization:
            return _MISSING
        scheme, _, token = authorization.partition(b" ")
        digest = hashlib.sha256(token.strip()).digest()
        shortcut = self.shortcut
        if shortcut is not None and hmac.compare_digest(digest, shortcut.digest):
            key: ApiKey | None = shortcut
        else:
            key = self.keys.by_digest.get(digest)
            if key is not None and not hmac.compare_digest(digest, key.digest):
                key = None
        if key is None or scheme.lower() != b"bearer":
            return _INVALID
        if key.expires is not None and key.expired(self.wall()):
            return _EXPIRED
        return key

    def take(self, key: ApiKey) -> Taken | None:
        """Count one request of ``key`` against its requests per minute (None: it has no such limit)."""
        if key.requests_per_minute is None or key.name is None:
            return None
        now = self.clock()
        bucket = self.buckets.get(key.name)
        if bucket is None or bucket.limit != key.requests_per_minute:
            bucket = self.buckets[key.name] = RequestBucket(key.requests_per_minute, now)
        return bucket.take(now)
