"""The router's side of the request log (R-6.20): the records it keeps, for its reports and a file.

With `gateway.request_log.enabled`, the router's handler hands every request's record to `RequestLog`
when `keeps()` says so (a `sample` share of them, drawn per request; every one at 1, none at 0,
without a draw at either); the feed state hands what was kept since the last report to the next
one (`take`), where the control plane counts each (router, seq) once, as it does usage.

Bounded: at most RECORDS_KEPT records wait for a report. Past that (nobody takes reports) the
oldest are dropped and counted (`dropped`), with one warning per spell of drops. A report that
could not be sent is merged with the next one in the spool (router/spool.py), which keeps the
newest REQUESTS_PER_REPORT records of the two in the same way: a report stays well within the
control plane's 8 MB, and a long outage holds that many records, not one per request served.

With `gateway.request_log.path`, each kept record is also appended to that file on the router's
host as a line of JSON (its wire form, `request_record_to_wire`), by a thread of its own that
writes what came in every FILE_FLUSH_SECONDS: the request path only appends the record to a
deque. A file that cannot be opened or written is logged once, with the reason, and tried again
every FILE_RETRY_SECONDS, its records meanwhile dropped: never fatal, and the reports go on. A
file renamed away (logrotate) is opened again at its path. Settings apply as the feed changes them.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from collections import deque

from llmgw.contracts.feed import GatewaySettings, RequestRecord, request_record_to_wire

log = logging.getLogger(__name__)

RECORDS_KEPT = 10_000  # records waiting for the next report (about 350 bytes each on the wire)
REQUESTS_PER_REPORT = RECORDS_KEPT  # the most a report carries, merged ones included (router/spool.py)
FILE_FLUSH_SECONDS = 0.2  # the file's writer takes what came in this often
FILE_PENDING = 100_000  # records waiting for the file's writer; past it the oldest are dropped
FILE_RETRY_SECONDS = 60.0  # a file that could not be opened or written is tried again after this
FILE_MODE = 0o600  # a new file: records name keys and clients' addresses

_encode = json.JSONEncoder(separators=(",", ":")).encode  # made once: json.dumps makes one per call
_DEFAULTS = GatewaySettings(max_body=0, request_timeout=0.0, on_demand_wait=0.0)


class RequestLog:
    """The records this router keeps until its next report, and its file writer."""

    def __init__(self):
        self.enabled = _DEFAULTS.request_log
        self.sample = _DEFAULTS.request_log_sample
        self._records: deque[RequestRecord] = deque(maxlen=RECORDS_KEPT)
        self.dropped = 0  # records dropped for want of a report, since the router started
        self._dropping = False  # in a spell of drops: warned once, not again until a report takes some
        self._file: RequestLogFile | None = None

    def configure(self, gateway: GatewaySettings) -> None:
        """The gateway settings in force (the feed's, as they change)."""
        self.enabled = gateway.request_log
        self.sample = gateway.request_log_sample
        path = gateway.request_log_path if gateway.request_log else None
        current = self._file
        if current is not None and current.path != path:
            current.close(wait=False)  # it writes what it holds, then ends
            self._file = current = None
        if path is not None and current is None:
            self._file = RequestLogFile(path)

    def keeps(self) -> bool:
        """Whether this request's record is kept: drawn per request with the sample share."""
        sample = self.sample
        return self.enabled and (sample >= 1.0 or random.random() < sample)

    def keep(self, record: RequestRecord) -> None:
        records = self._records
        if len(records) == RECORDS_KEPT:  # the deque drops the oldest: count it
            self.dropped += 1
            if not self._dropping:
                self._dropping = True
                log.warning("request log: %d records wait for a report, the most kept; the oldest are dropped "
                            "until the next report takes them (%d dropped so far)", RECORDS_KEPT, self.dropped)
        records.append(record)
        if self._file is not None:
            self._file.put(record)

    def take(self) -> tuple[RequestRecord, ...]:
        """The records kept since the last call, oldest first, handed over once."""
        records = self._records
        if not records:
            return ()
        taken = tuple(records)
        records.clear()
        self._dropping = False
        return taken

    def close(self) -> None:
        """Write what the file's writer holds and end it (blocks up to a few seconds: call off the loop)."""
        current, self._file = self._file, None
        if current is not None:
            current.close(wait=True)


class RequestLogFile:
    """Appends records to one file as JSON lines, from a thread of its own."""

    def __init__(self, path: str):
        self.path = path
        self.dropped = 0  # records that never reached the file
        self._pending: deque[RequestRecord] = deque(maxlen=FILE_PENDING)
        self._stop = threading.Event()
        self._fd: int | None = None
        self._inode: tuple[int, int] | None = None
        self._failed_at: float | None = None  # when it last could not open or write the file
        self._thread = threading.Thread(target=self._run, name="llmgw-request-log", daemon=True)
        self._thread.start()

    def put(self, record: RequestRecord) -> None:
        pending = self._pending
        if len(pending) == FILE_PENDING:
            self.dropped += 1
        pending.append(record)

    def close(self, wait: bool) -> None:
        self._stop.set()
        if wait:
            self._thread.join(timeout=10)

    # -- the writer's thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                stopping = self._stop.wait(FILE_FLUSH_SECONDS)
                self._flush()
                if stopping:
                    return
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _flush(self) -> None:
        pending = self._pending
        if not pending:
            return
        records = []
        while pending:
            records.append(pending.popleft())  # the loop appends meanwhile: popleft takes each once
        if not self._writable():
            self.dropped += len(records)
            return
        data = "".join([_encode(request_record_to_wire(r)) + "\n" for r in records]).encode()
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as exc:
            self.dropped += len(records)
            self._failed(f"cannot write to it: {exc.strerror or exc}")

    def _writable(self) -> bool:
        """The file open at its path: opened again when it was renamed away, or after a failure once
        FILE_RETRY_SECONDS have passed."""
        path = os.path.expanduser(self.path)
        if self._fd is not None:
            try:
                st = os.stat(path)
            except OSError:
                st = None
            if st is not None and (st.st_dev, st.st_ino) == self._inode:
                return True
            os.close(self._fd)  # rotated or removed: a new file at the path
            self._fd = None
        if self._failed_at is not None and time.monotonic() - self._failed_at < FILE_RETRY_SECONDS:
            return False
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        except OSError as exc:
            self._failed(f"cannot open it: {exc.strerror or exc}")
            return False
        st = os.fstat(fd)
        self._fd, self._inode = fd, (st.st_dev, st.st_ino)
        if self._failed_at is not None:
            log.info("request log: writing to %s again", self.path)
            self._failed_at = None
        return True

    def _failed(self, why: str) -> None:
        if self._failed_at is None:  # once per spell of failures
            log.warning("request log: %s (gateway.request_log.path) %s; its records are dropped until it can "
                        "be written (tried again every %.0f s); the control plane still gets them",
                        self.path, why, FILE_RETRY_SECONDS)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._failed_at = time.monotonic()
