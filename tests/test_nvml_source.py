"""NvmlSource against a fake pynvml (every NVML state we can think of) and the real one."""

from __future__ import annotations

import pynvml
import pytest
from fake_nvml import VALUE_NOT_AVAILABLE, FakeClock, FakeDevice, FakeNvml, GiB, MiB
from hypothesis import given, settings
from hypothesis import strategies as st

from memtop.model import SOURCE_NVML, SOURCE_SIM, GpuProcess
from memtop.sources.nvml import DEFAULT_RETRY_INTERVAL, NvmlSource, nvml_error_line

UUID0 = "GPU-11111111-1111-1111-1111-111111111111"
UUID1 = "GPU-22222222-2222-2222-2222-222222222222"


def two_gpus(**kwargs: object) -> FakeNvml:
    return FakeNvml(
        [
            FakeDevice(
                name="NVIDIA H100 80GB HBM3",
                uuid=UUID0,
                total=80 * GiB,
                used=30 * GiB,
                reserved=512 * MiB,
                compute=[(100, 20 * GiB), (101, 9 * GiB), (102, None)],
                graphics=[(100, 1 * GiB), (200, 64 * MiB)],
                utilization=(97, 40),
                temperature=71,
            ),
            FakeDevice(
                name="NVIDIA H100 80GB HBM3",
                uuid=UUID1,
                total=80 * GiB,
                used=2 * GiB,
                reserved=512 * MiB,
                compute=[(300, VALUE_NOT_AVAILABLE)],
                utilization=(3, 1),
                temperature=35,
            ),
        ],
        **kwargs,  # type: ignore[arg-type]
    )


def make_source(fake: FakeNvml, **kwargs: object) -> tuple[NvmlSource, FakeClock]:
    clock = FakeClock()
    return NvmlSource(fake, clock=clock, **kwargs), clock  # type: ignore[arg-type]


# -- healthy ---------------------------------------------------------------------------------------


def test_healthy_two_gpus() -> None:
    fake = two_gpus()
    source, _ = make_source(fake)
    reading = source.read()

    assert reading.available
    assert reading.error is None
    assert reading.driver_version == "550.54.15"
    assert reading.source == SOURCE_NVML
    assert [d.index for d in reading.devices] == [0, 1]
    d0, d1 = reading.devices
    assert (d0.uuid, d1.uuid) == (UUID0, UUID1)
    assert d0.name == "NVIDIA H100 80GB HBM3"
    # v2: used excludes the reserved memory; free is what is left after both.
    assert d0.total_bytes == 80 * GiB
    assert d0.used_bytes == 30 * GiB
    assert d0.free_bytes == 80 * GiB - 30 * GiB - 512 * MiB
    assert d0.utilization_percent == 97
    assert d0.memory_utilization_percent == 40
    assert d0.temperature_c == 71
    assert d0.error is None
    assert d0.source == SOURCE_NVML
    # pid 100 is in both lists: one entry, the larger usage, kind of the compute entry.
    assert d0.processes == (
        GpuProcess(pid=100, used_bytes=20 * GiB, kind="compute"),
        GpuProcess(pid=101, used_bytes=9 * GiB, kind="compute"),
        GpuProcess(pid=102, used_bytes=None, kind="compute"),
        GpuProcess(pid=200, used_bytes=64 * MiB, kind="graphics"),
    )
    # The raw NVML_VALUE_NOT_AVAILABLE of an old binding is None too.
    assert d1.processes == (GpuProcess(pid=300, used_bytes=None, kind="compute"),)
    assert d1.used_bytes == 2 * GiB
    assert d1.temperature_c == 35


def test_merge_keeps_larger_used_whichever_list_has_it() -> None:
    fake = FakeNvml([FakeDevice(compute=[(7, None), (8, MiB)], graphics=[(7, 5 * MiB), (8, None)])])
    source, _ = make_source(fake)
    (device,) = source.read().devices
    assert device.processes == (
        GpuProcess(pid=7, used_bytes=5 * MiB, kind="compute"),
        GpuProcess(pid=8, used_bytes=MiB, kind="compute"),
    )


def test_source_label_is_copied_everywhere() -> None:
    source, _ = make_source(two_gpus(), source=SOURCE_SIM)
    reading = source.read()
    assert reading.source == SOURCE_SIM
    assert {d.source for d in reading.devices} == {SOURCE_SIM}


def test_no_devices_is_available_with_nothing_to_show() -> None:
    source, _ = make_source(FakeNvml([]))
    reading = source.read()
    assert reading.available
    assert reading.devices == ()


def test_bytes_from_old_bindings_are_decoded() -> None:
    fake = two_gpus(strings_as_bytes=True)
    source, _ = make_source(fake)
    reading = source.read()
    assert reading.driver_version == "550.54.15"
    assert reading.devices[0].uuid == UUID0
    assert reading.devices[0].name == "NVIDIA H100 80GB HBM3"
    assert all(isinstance(d.name, str) and isinstance(d.uuid, str) for d in reading.devices)


# -- caching ---------------------------------------------------------------------------------------


def test_handles_and_identity_are_cached_across_reads() -> None:
    fake = two_gpus()
    source, _ = make_source(fake)
    for _ in range(5):
        assert source.read().available
    assert fake.count("nvmlInit") == 1
    for index in (0, 1):
        assert fake.count("nvmlDeviceGetHandleByIndex", index) == 1
        assert fake.count("nvmlDeviceGetUUID", index) == 1
        assert fake.count("nvmlDeviceGetName", index) == 1
        assert fake.count("nvmlDeviceGetMemoryInfo_v2", index) == 5
    assert fake.count("nvmlSystemGetDriverVersion") == 1


def test_count_change_re_enumerates() -> None:
    fake = two_gpus()
    source, _ = make_source(fake)
    assert len(source.read().devices) == 2
    fake.devices.append(FakeDevice(uuid="GPU-3", name="third"))
    reading = source.read()
    assert [d.uuid for d in reading.devices] == [UUID0, UUID1, "GPU-3"]
    assert fake.count("nvmlDeviceGetHandleByIndex", 0) == 2
    assert fake.count("nvmlDeviceGetHandleByIndex", 2) == 1


# -- memory info versions --------------------------------------------------------------------------


def test_v2_falls_back_to_v1_when_driver_lacks_it_and_remembers() -> None:
    fake = two_gpus()
    fake.devices[1].memory_v2 = False  # an old driver for this device: FunctionNotFound
    source, _ = make_source(fake)
    for _ in range(3):
        reading = source.read()
    d0, d1 = reading.devices
    assert d1.error is None
    # v1: used includes the reserved memory (total - free).
    assert d1.used_bytes == 2 * GiB + 512 * MiB
    assert d1.free_bytes == 80 * GiB - 2 * GiB - 512 * MiB
    assert d1.total_bytes == 80 * GiB
    assert fake.count("nvmlDeviceGetMemoryInfo_v2", 1) == 1  # tried once, then remembered
    assert fake.count("nvmlDeviceGetMemoryInfo", 1) == 3
    # The other device keeps v2.
    assert d0.used_bytes == 30 * GiB
    assert fake.count("nvmlDeviceGetMemoryInfo", 0) == 0


@pytest.mark.parametrize(
    "error", [pynvml.NVMLError_NotSupported, pynvml.NVMLError_ArgumentVersionMismatch]
)
def test_v2_falls_back_on_not_supported(error: type[Exception]) -> None:
    fake = two_gpus()
    fake.fail("nvmlDeviceGetMemoryInfo_v2", error=error)
    source, _ = make_source(fake)
    reading = source.read()
    assert [d.used_bytes for d in reading.devices] == [30 * GiB + 512 * MiB, 2 * GiB + 512 * MiB]
    assert all(d.error is None for d in reading.devices)


def test_old_binding_without_version_argument_uses_v1() -> None:
    fake = two_gpus(binding_has_memory_v2=False)
    source, _ = make_source(fake)
    source.read()
    reading = source.read()
    assert reading.devices[0].used_bytes == 30 * GiB + 512 * MiB
    assert reading.devices[0].error is None
    assert fake.count("nvmlDeviceGetMemoryInfo", 0) == 2


def test_lib_without_memory_v2_constant_uses_v1() -> None:
    fake = two_gpus()
    fake.nvmlMemory_v2 = None  # type: ignore[assignment]
    source, _ = make_source(fake)
    assert source.read().devices[0].used_bytes == 30 * GiB + 512 * MiB
    assert fake.count("nvmlDeviceGetMemoryInfo_v2") == 0


def test_memory_error_other_than_fallback_is_reported_not_hidden() -> None:
    fake = two_gpus()
    fake.fail("nvmlDeviceGetMemoryInfo", index=0, error=pynvml.NVMLError_Unknown)
    source, _ = make_source(fake)
    d0, d1 = source.read().devices
    assert d0.error == "memory: NVML error: Unknown Error"
    assert (d0.total_bytes, d0.used_bytes, d0.free_bytes) == (None, None, None)
    # The rest of the device is still read.
    assert d0.utilization_percent == 97
    assert len(d0.processes) == 4
    assert d1.error is None


# -- NVML not usable -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (
            pynvml.NVMLError_LibraryNotFound,
            "NVML not available: libnvidia-ml.so.1 not found (no NVIDIA driver on this machine)",
        ),
        (pynvml.NVMLError_DriverNotLoaded, "NVML: driver not loaded"),
        (pynvml.NVMLError_NoPermission, "NVML: insufficient permissions"),
        (pynvml.NVMLError_LibRmVersionMismatch, "NVML: library and driver versions differ"),
    ],
)
def test_init_failure_is_an_unavailable_reading(error: type[Exception], expected: str) -> None:
    fake = two_gpus()
    fake.fail("nvmlInit", error=error)
    source, _ = make_source(fake)
    reading = source.read()
    assert not reading.available
    assert reading.devices == ()
    assert reading.error is not None
    assert reading.error.startswith(expected)
    assert "\n" not in reading.error
    assert fake.count("nvmlDeviceGetCount") == 0


def test_init_retry_is_throttled_then_recovers() -> None:
    fake = two_gpus()
    fake.fail("nvmlInit", error=pynvml.NVMLError_DriverNotLoaded)
    source, clock = make_source(fake)
    for _ in range(20):
        assert not source.read().available
        clock.advance(0.4)  # 8 s in all
    assert fake.count("nvmlInit") == 1
    clock.advance(DEFAULT_RETRY_INTERVAL)
    assert not source.read().available
    assert fake.count("nvmlInit") == 2
    # Still throttled: the driver comes back, but the next try is 10 s after the last one.
    fake.clear("nvmlInit")
    clock.advance(DEFAULT_RETRY_INTERVAL / 2)
    assert not source.read().available
    assert fake.count("nvmlInit") == 2
    clock.advance(DEFAULT_RETRY_INTERVAL / 2)
    reading = source.read()
    assert reading.available
    assert reading.error is None
    assert len(reading.devices) == 2
    assert fake.count("nvmlInit") == 3


def test_retry_interval_is_configurable() -> None:
    fake = two_gpus()
    fake.fail("nvmlInit", error=pynvml.NVMLError_DriverNotLoaded)
    source, clock = make_source(fake, retry_interval=2.0)
    source.read()
    clock.advance(1.9)
    source.read()
    assert fake.count("nvmlInit") == 1
    clock.advance(0.1)
    source.read()
    assert fake.count("nvmlInit") == 2


def test_driver_going_away_mid_run_re_initialises_later() -> None:
    fake = two_gpus()
    source, clock = make_source(fake)
    assert source.read().available
    fake.fail("nvmlDeviceGetCount", error=pynvml.NVMLError_Uninitialized)
    reading = source.read()
    assert not reading.available
    assert reading.error == "NVML: not initialised"
    assert fake.count("nvmlShutdown") == 1  # gave back its init before starting over
    fake.clear()
    clock.advance(1)
    assert not source.read().available  # throttled
    clock.advance(DEFAULT_RETRY_INTERVAL)
    assert source.read().available
    assert fake.count("nvmlInit") == 2
    assert fake.count("nvmlDeviceGetHandleByIndex", 0) == 2  # handles from the new session


def test_transient_count_failure_keeps_known_devices() -> None:
    fake = two_gpus()
    source, _ = make_source(fake)
    source.read()
    fake.fail("nvmlDeviceGetCount", error=pynvml.NVMLError_Unknown, times=1)
    reading = source.read()
    assert reading.available
    assert [d.used_bytes for d in reading.devices] == [30 * GiB, 2 * GiB]
    assert fake.count("nvmlInit") == 1


def test_count_failure_on_first_read_is_unavailable() -> None:
    fake = two_gpus()
    fake.fail("nvmlDeviceGetCount", error=pynvml.NVMLError_Unknown, times=1)
    source, _ = make_source(fake)
    reading = source.read()
    assert not reading.available
    assert reading.error == "NVML error: Unknown Error"


def test_missing_pynvml_package_is_an_unavailable_reading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    reading = NvmlSource().read()
    assert not reading.available
    assert reading.error is not None
    assert "nvidia-ml-py" in reading.error


# -- per-device errors -----------------------------------------------------------------------------


def test_gpu_lost_on_one_device_other_reads_fine_and_recovers_slowly() -> None:
    fake = two_gpus()
    source, clock = make_source(fake)
    assert source.read().devices[1].error is None
    fake.fail("nvmlDeviceGetMemoryInfo", index=1, error=pynvml.NVMLError_GpuIsLost)

    reading = source.read()
    assert reading.available
    d0, d1 = reading.devices
    assert d0.error is None
    assert d0.used_bytes == 30 * GiB
    assert d1.error == "GPU is lost (fallen off the bus)"
    assert (d1.index, d1.uuid) == (1, UUID1)  # still identifiable
    assert (d1.total_bytes, d1.used_bytes, d1.free_bytes) == (None, None, None)
    assert d1.utilization_percent is None
    assert d1.temperature_c is None
    assert d1.processes == ()

    # A lost GPU is not queried again every second (its calls can take seconds each).
    calls_before = sum(n for (_, index), n in fake.calls.items() if index == 1)
    for _ in range(5):
        clock.advance(1)
        assert source.read().devices[1].error == "GPU is lost (fallen off the bus)"
    assert sum(n for (_, index), n in fake.calls.items() if index == 1) == calls_before

    # At the retry pace the handle is fetched again; still lost, then back.
    clock.advance(DEFAULT_RETRY_INTERVAL)
    assert source.read().devices[1].error == "GPU is lost (fallen off the bus)"
    assert fake.count("nvmlDeviceGetHandleByIndex", 1) == 2
    fake.clear()
    clock.advance(DEFAULT_RETRY_INTERVAL)
    d1 = source.read().devices[1]
    assert d1.error is None
    assert d1.used_bytes == 2 * GiB
    assert fake.count("nvmlDeviceGetHandleByIndex", 1) == 3
    assert fake.count("nvmlDeviceGetHandleByIndex", 0) == 1


def test_gpu_lost_while_opening() -> None:
    fake = two_gpus()
    fake.fail("nvmlDeviceGetHandleByIndex", index=0, error=pynvml.NVMLError_GpuIsLost)
    source, _ = make_source(fake)
    d0, d1 = source.read().devices
    assert d0.error == "GPU is lost (fallen off the bus)"
    assert d0.name == ""
    assert d0.total_bytes is None
    assert d1.error is None


def test_gpu_lost_in_process_list() -> None:
    fake = two_gpus()
    fake.fail("nvmlDeviceGetGraphicsRunningProcesses", index=0, error=pynvml.NVMLError_GpuIsLost)
    source, _ = make_source(fake)
    d0, d1 = source.read().devices
    assert d0.error == "GPU is lost (fallen off the bus)"
    assert d0.used_bytes is None  # a lost device reports nothing half-read
    assert d1.error is None


def test_not_supported_utilisation_and_temperature_are_none_silently() -> None:
    fake = two_gpus()
    fake.devices[0].utilization = None
    fake.devices[0].temperature = None
    source, _ = make_source(fake)
    for _ in range(3):
        d0 = source.read().devices[0]
    assert d0.utilization_percent is None
    assert d0.memory_utilization_percent is None
    assert d0.temperature_c is None
    assert d0.error is None
    assert d0.used_bytes == 30 * GiB
    # Not asked again once NotSupported.
    assert fake.count("nvmlDeviceGetUtilizationRates", 0) == 1
    assert fake.count("nvmlDeviceGetTemperature", 0) == 1
    assert fake.count("nvmlDeviceGetUtilizationRates", 1) == 3


def test_lib_without_optional_functions() -> None:
    """A simulated lib may implement only what memory needs."""

    class Minimal:
        def __init__(self, fake: FakeNvml) -> None:
            self.nvmlInit = fake.nvmlInit
            self.nvmlDeviceGetCount = fake.nvmlDeviceGetCount
            self.nvmlDeviceGetHandleByIndex = fake.nvmlDeviceGetHandleByIndex
            self.nvmlDeviceGetMemoryInfo = fake.nvmlDeviceGetMemoryInfo

    source, _ = make_source(Minimal(two_gpus()))  # type: ignore[arg-type]
    reading = source.read()
    assert reading.available
    assert reading.driver_version is None
    d0 = reading.devices[0]
    assert (d0.name, d0.uuid) == ("GPU 0", "")
    assert d0.used_bytes == 30 * GiB + 512 * MiB  # no nvmlMemory_v2 constant: v1
    assert d0.processes == ()
    assert d0.utilization_percent is None
    assert d0.error is None
    source.close()  # no nvmlShutdown: nothing to call, no error


def test_no_permission_for_process_lists() -> None:
    fake = two_gpus()
    fake.fail("nvmlDeviceGetComputeRunningProcesses", error=pynvml.NVMLError_NoPermission)
    source, _ = make_source(fake)
    d0, d1 = source.read().devices
    for device in (d0, d1):
        assert device.processes == ()
        assert device.error == "no permission to list processes"
    # Memory and the rest are still there.
    assert d0.used_bytes == 30 * GiB
    assert d0.utilization_percent == 97


def test_unknown_error_in_process_list_keeps_the_other_list() -> None:
    fake = two_gpus()
    fake.fail("nvmlDeviceGetComputeRunningProcesses", index=0, error=pynvml.NVMLError_Unknown)
    source, _ = make_source(fake)
    d0 = source.read().devices[0]
    assert d0.error == "processes: NVML error: Unknown Error"
    assert [p.pid for p in d0.processes] == [100, 200]
    assert d0.processes[0].kind == "graphics"


def test_errors_of_several_fields_join_in_one_line() -> None:
    fake = two_gpus()
    fake.fail("nvmlDeviceGetMemoryInfo", index=0, error=pynvml.NVMLError_Timeout)
    fake.fail("nvmlDeviceGetTemperature", index=0, error=pynvml.NVMLError_Unknown)
    source, _ = make_source(fake)
    d0 = source.read().devices[0]
    assert d0.error == "memory: NVML: timed out; temperature: NVML error: Unknown Error"


def test_old_driver_without_v3_process_functions_uses_v2() -> None:
    fake = two_gpus(driver_has_v3_processes=False)
    source, _ = make_source(fake)
    for _ in range(3):
        d0 = source.read().devices[0]
    assert [p.pid for p in d0.processes] == [100, 101, 102, 200]
    assert d0.error is None
    # The unversioned wrapper is tried once (per function), the _v2 one used from then on.
    assert fake.count("nvmlDeviceGetComputeRunningProcesses") == 1
    assert fake.count("nvmlDeviceGetComputeRunningProcesses_v2", 0) == 3
    assert fake.count("nvmlDeviceGetGraphicsRunningProcesses") == 1


def test_unexpected_exception_from_lib_never_escapes() -> None:
    fake = two_gpus()
    fake.fail("nvmlDeviceGetCount", error=RuntimeError("boom\nsecond line"))
    source, _ = make_source(fake)
    reading = source.read()
    assert not reading.available
    assert reading.error == "NVML: unexpected RuntimeError: boom second line"


def test_close_is_idempotent_and_read_after_close_reinitialises() -> None:
    fake = two_gpus()
    source, _ = make_source(fake)
    source.close()
    assert fake.count("nvmlShutdown") == 0  # never initialised: nothing to shut down
    source.read()
    source.close()
    source.close()
    assert fake.count("nvmlShutdown") == 1
    assert fake.initialised == 0
    assert source.read().available
    assert fake.count("nvmlInit") == 2
    source.close()
    assert fake.initialised == 0


def test_close_after_failed_init_does_not_shut_down() -> None:
    fake = two_gpus()
    fake.fail("nvmlInit", error=pynvml.NVMLError_LibraryNotFound)
    source, _ = make_source(fake)
    source.read()
    source.close()
    assert fake.count("nvmlShutdown") == 0


# -- nvml_error_line -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "line"),
    [
        (pynvml.NVMLError_GpuIsLost(), "GPU is lost (fallen off the bus)"),
        (pynvml.NVMLError_NoPermission(), "NVML: insufficient permissions"),
        (pynvml.NVMLError_Unknown(), "NVML error: Unknown Error"),
        (pynvml.NVMLError(pynvml.NVML_ERROR_IN_USE), "NVML error: NVML Error with code 19"),
        (pynvml.NVMLLibraryMismatchError("x"), "NVML: function not found"),
        (ValueError("a\n  b"), "NVML: unexpected ValueError: a b"),
    ],
)
def test_nvml_error_line(exc: BaseException, line: str) -> None:
    assert nvml_error_line(exc).startswith(line)


def test_nvml_error_line_recognises_foreign_error_classes_by_name_or_code() -> None:
    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(value)
            self.value = value

    class NVMLError_GpuIsLost(NVMLError):
        pass

    assert nvml_error_line(NVMLError_GpuIsLost(0)) == "GPU is lost (fallen off the bus)"
    assert nvml_error_line(NVMLError(9)).startswith("NVML: driver not loaded")


def test_nvml_error_line_is_one_bounded_line() -> None:
    line = nvml_error_line(RuntimeError("x" * 1000 + "\n" + "y"))
    assert "\n" not in line
    assert len(line) <= 200


# -- whatever fails, read() returns something coherent ---------------------------------------------

_FUNCTIONS = [
    "nvmlInit",
    "nvmlSystemGetDriverVersion",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetTemperature",
]
_ERRORS = [
    pynvml.NVMLError_GpuIsLost,
    pynvml.NVMLError_NotSupported,
    pynvml.NVMLError_NoPermission,
    pynvml.NVMLError_Unknown,
    pynvml.NVMLError_Uninitialized,
    pynvml.NVMLError_FunctionNotFound,
    pynvml.NVMLError_DriverNotLoaded,
    pynvml.NVMLError_Timeout,
    TypeError,
    RuntimeError,
]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(_FUNCTIONS),
            st.sampled_from([None, 0, 1]),
            st.sampled_from(_ERRORS),
            st.sampled_from([None, 1, 2]),
        ),
        max_size=4,
    ),
    st.lists(st.floats(min_value=0, max_value=30), min_size=1, max_size=6),
)
def test_read_never_raises_under_any_failure(
    failures: list[tuple[str, int | None, type[Exception], int | None]], steps: list[float]
) -> None:
    fake = two_gpus()
    for function, index, error, times in failures:
        fake.fail(function, index=index, error=error, times=times)
    source, clock = make_source(fake)
    for step in steps:
        reading = source.read()
        if not reading.available:
            assert reading.error
            assert reading.devices == ()
        for device in reading.devices:
            assert device.source == SOURCE_NVML
            if device.error is not None:
                assert "\n" not in device.error
            if device.used_bytes is not None:
                assert device.total_bytes is not None
        clock.advance(step)
    source.close()
    # Every successful init is matched by a shutdown once closed.
    assert fake.initialised == 0


# -- the real pynvml on this machine ---------------------------------------------------------------


def test_real_pynvml_without_gpu_reports_unavailable() -> None:
    source = NvmlSource()
    try:
        reading = source.read()
        if reading.available:
            pytest.skip("NVML works on this machine (a GPU driver is present)")
        assert reading.error is not None
        assert "NVML" in reading.error
        assert "\n" not in reading.error
        assert reading.devices == ()
        assert source.read().error == reading.error  # second read: throttled, same answer
    finally:
        source.close()


def test_real_pynvml_with_gpu_reads_devices() -> None:
    source = NvmlSource()
    try:
        reading = source.read()
        if not reading.available:
            pytest.skip(f"no NVML here: {reading.error}")
        assert reading.driver_version
        for device in reading.devices:
            assert device.uuid.startswith(("GPU-", "MIG-"))
            if device.error is None:
                assert device.total_bytes and device.total_bytes > 0
                assert device.used_bytes is not None
                assert device.free_bytes is not None
                assert device.used_bytes + device.free_bytes <= device.total_bytes
    finally:
        source.close()
