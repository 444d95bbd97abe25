"""The GPU preflight. There is no GPU here: the NVML reading is a small data object built by hand,
the one place a stand-in is right; the allocation test runs for real (it fails without CUDA)."""

import sys
import types

import pytest

from fitfinder.probe import preflight
from fitfinder.errors import CardNotClean
from fitfinder.probe.preflight import AllocationTest, CardReading, GpuProcess

GiB, MiB = 2**30, 2**20
OK = AllocationTest(True, 2.5)


def card(free_gib: float, *processes: GpuProcess, total_gib: float = 24) -> CardReading:
    return CardReading(0, "NVIDIA GeForce RTX 4090", int(total_gib * GiB), int(free_gib * GiB), processes)


class Lines:
    def __init__(self):
        self.notes = []

    def note(self, text):
        self.notes.append(text)


def test_a_clean_card_passes_and_says_what_was_checked():
    report = preflight.check(0, 24 * GiB, read=lambda i: card(23.4), test=lambda i: OK)
    assert report.clean
    assert report.line() == ("preflight: GPU 0 (NVIDIA GeForce RTX 4090) is clean: 23.4 GiB free of 24 GiB, "
                             "no other process, 256 MiB and cuBLAS ok in 2.5 s")


def test_a_display_on_the_card_is_tolerated():
    xorg = GpuProcess(1404, 412 * MiB, "Xorg", compute=False)
    assert preflight.problems(card(23.3, xorg), OK) == []


def test_another_process_is_named_with_its_memory():
    leftover = GpuProcess(2231, int(20.87 * GiB), "python3")
    found = preflight.problems(card(2.6, leftover), OK, 24 * GiB)
    assert found == ["1 other process on it (pid 2231 python3: 20.9 GiB)",
                     "21.4 GiB of 24 GiB already in use"]


def test_memory_in_use_without_a_listed_process_is_not_clean():
    # In a container NVML often lists no process: the memory in use still tells.
    assert preflight.problems(card(17.0), OK) == ["7 GiB of 24 GiB already in use"]


def test_a_budget_smaller_than_the_card_only_needs_its_own_room():
    assert preflight.problems(card(60, total_gib=80), OK, budget_bytes=24 * GiB) == []
    assert preflight.problems(card(20, total_gib=80), OK, budget_bytes=24 * GiB) == [
        "only 20 GiB free for a 24 GiB budget"]


def test_a_failed_allocation_is_not_clean_even_on_an_empty_looking_card():
    failed = AllocationTest(False, 1.2, "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
                                        "`cublasCreate(handle)`")
    assert preflight.problems(card(23.5), failed) == [
        "a 256 MiB test allocation failed (RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
        "`cublasCreate(handle)`)"]


def test_a_dirty_card_stops_the_search_with_one_line():
    lines = Lines()
    leftover = GpuProcess(2231, 20 * GiB, "python3")
    with pytest.raises(CardNotClean) as stopped:
        preflight.ensure_clean(0, 24 * GiB, lines, read=lambda i: card(3.5, leftover), test=lambda i: OK)
    assert stopped.value.exit_code == 3 and lines.notes == []
    message = str(stopped.value)
    assert "\n" not in message
    assert message.startswith("GPU 0 (NVIDIA GeForce RTX 4090) is not clean: 1 other process on it (pid 2231 "
                              "python3: 20 GiB); 20.5 GiB of 24 GiB already in use.")
    assert message.endswith("`fitfinder search --force` searches anyway")


def test_force_goes_on_with_the_same_line_as_a_warning():
    lines = Lines()
    report = preflight.ensure_clean(0, 24 * GiB, lines, force=True, read=lambda i: card(10), test=lambda i: OK)
    assert not report.clean
    assert lines.notes == [f"warning: {report.line()}; going on (--force)"]


def test_a_clean_card_prints_one_note_and_goes_on():
    lines = Lines()
    assert preflight.ensure_clean(0, None, lines, read=lambda i: card(23.4), test=lambda i: OK).clean
    assert len(lines.notes) == 1 and "is clean" in lines.notes[0]


def test_an_unreadable_card_is_a_finding_not_a_crash():
    def broken(index):
        raise OSError("NVML Shared Library Not Found")

    report = preflight.check(3, read=broken, test=lambda i: pytest.fail("no test without a reading"))
    assert report.problems == ("NVML could not read GPU 3 (OSError: NVML Shared Library Not Found)",)
    assert report.line().startswith("the GPU is not clean: NVML could not read GPU 3")


def test_the_allocation_test_runs_in_its_own_process_and_reports_a_failure():
    # Without CUDA the test process answers with its error: the protocol, for real.
    result = preflight.allocation_test(0)
    assert not result.ok and result.seconds > 0
    assert "CUDA" in result.error or "NVIDIA" in result.error or "cuda" in result.error


def test_a_hung_allocation_test_is_killed():
    result = preflight.allocation_test(0, timeout=0.05)
    assert not result.ok and result.error.startswith("no answer in 0 s")


@pytest.mark.parametrize("visible, expected", [("", ("index", 1)), ("2,3", ("index", 3)),
                                               ("GPU-7f3a,GPU-99bc", ("uuid", "GPU-99bc"))])
def test_the_nvml_reading_follows_cuda_visible_devices(monkeypatch, visible, expected):
    """The NVML side of read_card, against a stand-in pynvml module."""
    asked = []
    fake = types.SimpleNamespace(
        NVMLError=RuntimeError,
        nvmlInit=lambda: None, nvmlShutdown=lambda: asked.append("shutdown"),
        nvmlDeviceGetHandleByIndex=lambda i: asked.append(("index", i)) or "handle",
        nvmlDeviceGetHandleByUUID=lambda u: asked.append(("uuid", u)) or "handle",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=24 * GiB, free=20 * GiB, used=4 * GiB),
        nvmlDeviceGetName=lambda h: b"NVIDIA L4",
        nvmlDeviceGetComputeRunningProcesses=lambda h: [types.SimpleNamespace(pid=77, usedGpuMemory=3 * GiB)],
        nvmlDeviceGetGraphicsRunningProcesses=lambda h: [types.SimpleNamespace(pid=5, usedGpuMemory=None)],
        nvmlSystemGetProcessName=lambda pid: b"/usr/bin/python3" if pid == 77 else b"/usr/lib/xorg/Xorg",
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    reading = preflight.read_card(1)
    assert asked == [expected, "shutdown"]
    assert reading == CardReading(1, "NVIDIA L4", 24 * GiB, 20 * GiB, (
        GpuProcess(77, 3 * GiB, "python3", True), GpuProcess(5, None, "Xorg", False)))


@pytest.mark.gpu
def test_preflight_on_a_real_card():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    report = preflight.check(0)
    assert report.reading.total_bytes > report.reading.free_bytes > 0
    assert report.allocation.ok, report.allocation.error


def test_search_on_a_dirty_gpu_stops_before_any_probe(monkeypatch, workdir):
    """The wiring in `fitfinder search --gpu 0`, with the card's reading stood in (no GPU here)."""
    from typer.testing import CliRunner

    from fitfinder import cli

    monkeypatch.setattr(cli, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(preflight, "read_card", lambda index: card(4, GpuProcess(2231, 19 * GiB, "python3")))
    monkeypatch.setattr(preflight, "allocation_test", lambda index: OK)
    monkeypatch.chdir(workdir)
    monkeypatch.delenv("FITFINDER_DEBUG", raising=False)
    result = CliRunner().invoke(cli.app, ["search", "configs/demo.yaml", "--gpu", "0"])
    assert result.exit_code == 3, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fitfinder: GPU 0 (NVIDIA GeForce RTX 4090) is not clean: "
                                                   "1 other process on it (pid 2231 python3: 19 GiB)")
    assert not (workdir / "studies").exists() and not (workdir / "results").exists()
