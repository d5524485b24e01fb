"""The device-source protocol, and what every driver library's source (NVML, amdsmi) shares.

A device source is polled by the sampler's device thread about once a second: `read()` gives
one `DriverReading` and never raises (a failure is data: `available=False` with the line that
explains it, or a device's `error`), `close()` lets the library go, and `source` names the kind
(`SourceKind`).  NVML (memtop.sources.nvml), amdsmi (memtop.sources.amdsmi) and the demo's
simulated GPUs (memtop.sim.devices_view) are the implementations; memtop.sources.devices lists
them and combines their readings.  A new vendor is a module with a `DriverLibrarySource` subclass
plus its line in that list.

`DriverLibrarySource` holds the part of a driver library's source that is the same for every
vendor: one read at a time under a lock, initialising the library lazily and again at a slow
pace after it failed or went down (`DriverDown`), and a device that stopped answering
(`DeviceLost`) asked again only after the retry interval, the other devices read as usual.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

from memtop.model import DeviceReading, DriverReading
from memtop.sources.driver_text import DeviceLost, DriverDown

_LOG = logging.getLogger(__name__)

# Seconds between attempts to initialise a library after a failure, and between attempts to
# reopen a device that was lost or could not be opened: slow enough not to hammer a sick driver.
DEFAULT_RETRY_INTERVAL = 10.0


@runtime_checkable
class DeviceSource(Protocol):
    """Where the GPUs' readings come from (DESIGN §12, "Devices")."""

    @property
    def source(self) -> str:
        """The kind of every reading it gives (a SourceKind)."""
        ...

    def read(self) -> DriverReading:
        """One poll of every device.  Never raises."""
        ...

    def close(self) -> None:
        """Let the library go; a later read starts it again.  Idempotent."""
        ...


@runtime_checkable
class DriverSource(DeviceSource, Protocol):
    """A device source over a vendor's driver library."""

    @property
    def library_found(self) -> bool:
        """Whether the vendor's library is on this machine: then, with no GPU answering, its
        error is the one that explains the empty box."""
        ...


@dataclass
class DriverDevice:
    """What a driver library's source keeps about one device between reads."""

    index: int
    handle: Any = None
    identified: bool = False  # uuid and name fetched for the current handle
    uuid: str = ""
    name: str = ""
    pci_bus_id: str | None = None  # canonical form; the join's second key (UUID first)
    absent: set[str] = field(default_factory=set)  # queries this device does not support
    # Why it is not queried now (lost, could not be opened), until retry_at.
    down_error: str | None = None
    retry_at: float = 0.0


D = TypeVar("D", bound=DriverDevice)


def joined_errors(errors: Sequence[str]) -> str | None:
    """A device reading's `error`: each failed query's line once, in order."""
    return "; ".join(dict.fromkeys(errors)) or None


class DriverLibrarySource(ABC, Generic[D]):
    """A device source over a driver library reached through a module-like `lib` (see the
    module docstring).  `read()` and `close()` may be called from different threads.

    A vendor says what differs: how to start the library (`_initialise`, which sets
    `_initialised` once the library is up), which devices to read (`_devices_to_read`), one
    device's queries (`_query_device`) and its reading when it cannot be queried
    (`_failed_device`), how to (re)open a device (`_reopen`), and how to read its errors
    (`error_line`, `_error_code`, the codes of a lost device and of a library gone down)."""

    NAME: ClassVar[str]  # "NVML", "amdsmi": in the log and the line of a library not ready
    SHUTDOWN: ClassVar[str]  # the library's function that shuts it down
    LOST_CODES: ClassVar[frozenset[int]]  # the device cannot be queried until reopened
    DOWN_CODES: ClassVar[frozenset[int]]  # the library as a whole stopped working
    ABSENT_CODES: ClassVar[frozenset[int]]  # the query does not exist here: stop asking

    def __init__(
        self,
        lib: Any | None,
        source: str,
        clock: Callable[[], float] = time.monotonic,
        retry_interval: float = DEFAULT_RETRY_INTERVAL,
    ) -> None:
        self._lib: Any = lib  # None until resolved on the first read
        self._source = source
        self._clock = clock
        self._retry_interval = retry_interval
        self._lock = threading.Lock()
        self._initialised = False
        self._init_error: str | None = None
        self._next_init_at: float | None = None  # None: try at once
        self._driver_version: str | None = None
        self._devices: list[D] = []

    @property
    def source(self) -> str:
        return self._source

    # -- public API ----------------------------------------------------------------------------

    def read(self) -> DriverReading:
        """One poll of every device. Never raises."""
        with self._lock:
            try:
                return self._read_locked()
            except Exception as exc:
                _LOG.debug("%s read failed", self.NAME, exc_info=True)
                return self._unavailable(self.error_line(exc))

    def close(self) -> None:
        """Shut the library down if this source initialised it. Idempotent; a later read
        initialises it again."""
        with self._lock:
            self._shutdown()
            self._next_init_at = None
            self._init_error = None

    # -- what a vendor says --------------------------------------------------------------------

    @abstractmethod
    def error_line(self, exc: BaseException) -> str:
        """One line, fit for a status bar, that says what a failure of the library means."""

    @abstractmethod
    def _error_code(self, exc: BaseException) -> int | None:
        """The library's status code behind `exc`, None when it is not the library's error."""

    @abstractmethod
    def _initialise(self) -> None:
        """Import and start the library (set `_initialised` once it is up: a failure after
        that shuts it down again); learn the devices and the driver version if it can."""

    @abstractmethod
    def _devices_to_read(self) -> Iterable[D]:
        """The devices of this round (raise DriverDown when the library is gone).  Read one by
        one as they come: a generator may yield devices that reading an earlier one found
        (NVML's MIG instances, after their GPU)."""

    @abstractmethod
    def _reopen(self, device: D, now: float) -> bool:
        """Make `device` queryable again (first read, or the retry after it was lost); False,
        with its `down_error` and `retry_at` set, when it is not (yet)."""

    @abstractmethod
    def _query_device(self, device: D, errors: list[str]) -> DeviceReading:
        """Every query of one device; a failed one adds its line to `errors` (a lost device
        or a dead library unwinds: `_check_fatal`)."""

    @abstractmethod
    def _failed_device(self, device: D, error: str) -> DeviceReading:
        """The reading of a device that cannot be queried now."""

    def _forget(self) -> None:
        """What else a vendor drops with its devices when the library shuts down."""

    def _query_error(self, key: str, code: int | None, exc: Exception) -> str | None:
        """The line a failed optional query adds to its device's error; None: say nothing."""
        return f"{key}: {self.error_line(exc)}"

    def _arguments(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """An optional query's arguments as the library takes them (asked at each call)."""
        return args

    # -- initialisation ------------------------------------------------------------------------

    def _unavailable(self, error: str) -> DriverReading:
        return DriverReading(
            available=False,
            driver_version=self._driver_version,
            error=error,
            source=self._source,
        )

    def _ensure_initialised(self) -> str | None:
        """Initialise the library if needed; the one-line reason when it is not usable (now)."""
        if self._initialised:
            return None
        now = self._clock()
        if self._next_init_at is not None and now < self._next_init_at:
            return self._init_error or f"{self.NAME} not available"
        self._next_init_at = now + self._retry_interval
        try:
            self._initialise()
        except Exception as exc:
            self._init_error = self.error_line(exc)
            _LOG.debug("%s initialisation failed: %s", self.NAME, self._init_error)
            self._shutdown()
            return self._init_error
        self._init_error = None
        self._next_init_at = None
        return None

    def _shutdown(self) -> None:
        was_initialised = self._initialised
        self._initialised = False
        self._devices = []
        self._forget()
        shutdown = getattr(self._lib, self.SHUTDOWN, None)
        if was_initialised and shutdown is not None:
            try:
                shutdown()
            except Exception:
                _LOG.debug("%s failed", self.SHUTDOWN, exc_info=True)

    # -- one poll ------------------------------------------------------------------------------

    def _read_locked(self) -> DriverReading:
        error = self._ensure_initialised()
        if error is not None:
            return self._unavailable(error)
        try:
            readings = tuple(self._read_device(device) for device in self._devices_to_read())
        except DriverDown as down:
            # The driver went away under us: start over, at the retry pace.
            self._shutdown()
            self._init_error = down.line
            self._next_init_at = self._clock() + self._retry_interval
            return self._unavailable(down.line)
        return DriverReading(
            available=True,
            devices=readings,
            driver_version=self._driver_version,
            source=self._source,
        )

    def _read_device(self, device: D) -> DeviceReading:
        now = self._clock()
        closed = device.handle is None or device.down_error is not None
        if closed and (now < device.retry_at or not self._reopen(device, now)):
            return self._failed_device(device, device.down_error or "GPU not available")
        try:
            return self._query_device(device, [])
        except DeviceLost as lost:
            device.down_error = lost.line
            device.retry_at = now + self._retry_interval
            return self._failed_device(device, lost.line)

    def _optional(self, device: D, key: str, errors: list[str], function: str, *args: Any) -> Any:
        """One query of `device` that may be unsupported (utilisation, temperature, power):
        its answer, or None (unsupported or missing: silently, and not asked again; failed:
        with `_query_error`'s line in `errors`).  A lost device or a dead library unwinds."""
        if key in device.absent:
            return None
        query = getattr(self._lib, function, None)
        if query is None:
            device.absent.add(key)
            return None
        try:
            return query(device.handle, *self._arguments(args))
        except Exception as exc:
            self._check_fatal(exc)
            code = self._error_code(exc)
            if code in self.ABSENT_CODES:
                device.absent.add(key)
            elif (line := self._query_error(key, code, exc)) is not None:
                errors.append(line)
            return None

    def _check_fatal(self, exc: Exception) -> None:
        """Turn a lost device or a dead library into the internal exceptions that unwind a
        read."""
        code = self._error_code(exc)
        if code in self.LOST_CODES:
            raise DeviceLost(self.error_line(exc)) from exc
        if code in self.DOWN_CODES:
            raise DriverDown(self.error_line(exc)) from exc
