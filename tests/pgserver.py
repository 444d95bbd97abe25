"""A throwaway PostgreSQL server for the scale-out tests (Debian's `postgresql` package).

    python tests/pgserver.py start DIR   # prints the URL of a fresh server on a free port
    python tests/pgserver.py stop DIR

.ci/run starts one this way and exports FITFINDER_TEST_POSTGRES; without it the tests start
their own. PostgreSQL refuses to run as root, so as root the server runs as the `postgres` user.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def binaries() -> Path | None:
    """The newest installed PostgreSQL's bin folder, or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else (Path(shutil.which("initdb")).parent if shutil.which("initdb")
                                                 else None)


def _as_owner(command: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(folder: Path) -> str:
    """initdb, start on a free port (TCP on 127.0.0.1 only), create the database; return its URL."""
    bin_dir = binaries()
    if bin_dir is None:
        raise RuntimeError("PostgreSQL is not installed (Debian: apt-get install postgresql)")
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "data"
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres", "postgres")
    port = free_port()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, "check": True}
    subprocess.run(_as_owner([str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "fitfinder",
                              "--no-sync"]), **quiet)
    options = f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off"
    subprocess.run(_as_owner([str(bin_dir / "pg_ctl"), "-D", str(data), "-o", options, "-l",
                              str(folder / "server.log"), "-w", "start"]), **quiet)
    for _ in range(50):
        done = subprocess.run(_as_owner([str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port),
                                         "-U", "fitfinder", "fitfinder"]), capture_output=True)
        if done.returncode == 0:
            return f"postgresql+psycopg2://fitfinder@127.0.0.1:{port}/fitfinder"
        time.sleep(0.2)
    raise RuntimeError(f"createdb failed: {done.stderr.decode()}")


def stop(folder: Path) -> None:
    bin_dir = binaries()
    subprocess.run(_as_owner([str(bin_dir / "pg_ctl"), "-D", str(folder / "data"), "-m", "immediate", "stop"]),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    action, where = sys.argv[1], Path(sys.argv[2])
    if action == "start":
        print(start(where))
    else:
        stop(where)
