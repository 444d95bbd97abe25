"""fitfinder's start-up hook in a trainer's processes: the child's side of a trainer probe.

fitfinder puts this folder first on the trainer's PYTHONPATH, so Python runs this file at start-up
in every Python process the trainer command starts. Here it only decides whether this process is
the one to meter, and waits:

- The meter goes into the trainer's main process only: the first process to import torch claims
  it (its pid goes into FITFINDER_TRAINER_METER_PID, which every process it starts inherits, and a
  claim file in the probe's folder refuses a second claimant started beside it). Its data-loader
  workers are not metered: a forked one is disarmed at the fork (trainer_meter), a spawned one
  sees the pid of another process.
- A process that never imports torch costs nothing: an import hook waits for torch, then starts
  fitfinder.probe.trainer_meter in it, read from the fitfinder the probe runs (the folder named in
  FITFINDER_TRAINER_METER), which is taken off sys.path again after.
- The user's own sitecustomize, the next one on sys.path, runs after this one, as it would have.

A failure here must never stop the trainer: it is written to the result file and the run goes on
unmetered (the parent then says the meter did not run).
"""

import json
import os
import sys

_CONFIG = "FITFINDER_TRAINER_METER"  # the probe's settings (JSON), set by fitfinder.probe.trainer
_OWNER = "FITFINDER_TRAINER_METER_PID"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _config():
    try:
        return json.loads(os.environ[_CONFIG])
    except (KeyError, ValueError):
        return None


def _metered_here() -> bool:
    owner = os.environ.get(_OWNER)
    return owner is None or owner == str(os.getpid())


def _die_with_fitfinder(config) -> None:
    """A trainer started by fitfinder itself dies when fitfinder does (Linux: PR_SET_PDEATHSIG), as a
    built-in probe does: a search killed mid-probe leaves no trainer holding the card."""
    if os.getppid() != config.get("parent"):
        return
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _claim(config) -> bool:
    """This process is the trainer's main one: no metered process started it, and none beside it."""
    if not _metered_here():
        return False
    try:
        fd = os.open(config["claim"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return os.environ.get(_OWNER) == str(os.getpid())
    except OSError:
        return False
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    os.environ[_OWNER] = str(os.getpid())
    return True


def _start_meter(config) -> None:
    if not _claim(config):
        return
    try:
        sys.path.insert(0, config["src"])
        try:
            from fitfinder.probe import trainer_meter
        finally:
            sys.path.remove(config["src"])
        trainer_meter.start(config)
    except Exception as exc:  # noqa: BLE001 - the trainer runs on, unmetered; the parent reads why
        try:
            with open(config["result"], "w") as handle:
                json.dump({"meter_error": f"{type(exc).__name__}: {exc}"[:2000], "pid": os.getpid()}, handle)
        except OSError:
            pass


class _AfterTorch:
    """A meta-path finder that lets torch import as usual, then starts the meter."""

    def __init__(self, config):
        self.config = config

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, config = spec.loader.exec_module, self.config

        def exec_then_meter(module):
            exec_module(module)
            _start_meter(config)

        spec.loader.exec_module = exec_then_meter  # this spec's own loader: one file's
        return spec


def _chain() -> None:
    """The user's sitecustomize, found on the path without this folder, as Python would have run it."""
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    ours = sys.modules.pop("sitecustomize", None)
    try:
        import importlib

        importlib.import_module("sitecustomize")
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours


_settings = _config()
if _settings is not None:
    _die_with_fitfinder(_settings)
if _settings is not None and _metered_here():
    if "torch" in sys.modules:
        _start_meter(_settings)
    else:
        sys.meta_path.insert(0, _AfterTorch(_settings))
_chain()
