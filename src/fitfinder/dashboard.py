"""`fitfinder dashboard`: optuna-dashboard over a study's storage, served from this machine.

It listens on 127.0.0.1 unless told otherwise: the dashboard can edit and delete studies, so it
is not offered to the network by default. Every probe fact is already a trial user attribute
(status, phase, peak per phase, s/step, verdict, error) and the objectives are named
(quality, seconds_per_sample), so the stock dashboard shows them as they are.
"""

from __future__ import annotations

import signal
import socketserver
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from fitfinder.errors import UserError


def storage_for(study_db: str | None, studies_dir: Path) -> tuple[str, str]:
    """(storage URL, what to call it) for a studies/NAME.db file, a study NAME, a storage URL,
    or nothing: then the one study in `studies_dir`."""
    studies_dir = Path(studies_dir)
    if study_db is None:
        found = sorted(studies_dir.glob("*.db"))
        if not found:
            raise UserError(f"no studies in {studies_dir}/; give STUDY_DB (a .db file or a storage URL), "
                            "or run `fitfinder search JOB.yaml` first")
        if len(found) > 1:
            raise UserError(f"{len(found)} studies in {studies_dir}/: {', '.join(p.name for p in found)}; "
                            f"say which, e.g. `fitfinder dashboard {found[0]}`")
        path = found[0]
    elif "://" in study_db:
        return study_db, study_db
    else:
        path = Path(study_db)
        if not path.exists() and (studies_dir / f"{study_db}.db").is_file():
            path = studies_dir / f"{study_db}.db"  # a bare study name
        if not path.is_file():
            here = ", ".join(p.name for p in sorted(studies_dir.glob("*.db"))) or "none"
            raise UserError(f"{study_db}: no such study file; studies in {studies_dir}/: {here}")
    _check_is_study_file(path)
    return f"sqlite:///{path.resolve()}", str(path)


def _check_is_study_file(path: Path) -> None:
    """Refuse a file that is not an Optuna SQLite storage, before Optuna would add its tables to it."""
    import sqlite3

    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            found = db.execute("SELECT name FROM sqlite_master WHERE type='table' AND name='studies'").fetchone()
        finally:
            db.close()
    except sqlite3.DatabaseError:
        found = None
    if not found:
        raise UserError(f"{path}: not an Optuna study database (made by `fitfinder search`)")


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a browser's open connection must not hold up Ctrl-C
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # one line per request would drown the URL
        pass


class Dashboard:
    """optuna-dashboard's WSGI app, bound to host:port (port 0: any free port)."""

    def __init__(self, storage_url: str, host: str = "127.0.0.1", port: int = 8080):
        import optuna
        import optuna_dashboard

        try:
            self.storage = optuna.storages.get_storage(storage_url)
            self.studies = self.storage.get_all_studies()
        except Exception as exc:  # not a database, or not an Optuna one
            raise UserError(f"{storage_url}: not an Optuna study storage ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:200]})") from None
        app = optuna_dashboard.wsgi(self.storage)
        try:
            self.server = make_server(host, port, app, server_class=_Server, handler_class=_QuietHandler)
        except OSError as exc:
            raise UserError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc}); "
                            "pick another port with --port, or --port 0 for any free one") from None
        self.host, self.port = host, self.server.server_address[1]

    @property
    def url(self) -> str:
        """The study's page when the storage holds one study, else the list of studies."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        page = f"/dashboard/studies/{self.studies[0]._study_id}" if len(self.studies) == 1 else "/dashboard"
        return f"http://{host}:{self.port}{page}"

    def serve(self) -> None:
        """Answer requests until Ctrl-C or SIGTERM, then close the socket."""
        previous = signal.signal(signal.SIGTERM, _interrupt)
        try:
            self.server.serve_forever(poll_interval=0.2)
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.server.server_close()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # `kill` stops the dashboard the way Ctrl-C does
