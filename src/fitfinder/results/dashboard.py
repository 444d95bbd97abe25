"""`fitfinder dashboard`: optuna-dashboard over a study's storage, served from this machine.

It listens on 127.0.0.1 unless told otherwise: the dashboard can edit and delete studies, so it
is not offered to the network by default. Listening on 127.0.0.1 is not enough on its own: a web
page can reach it by DNS rebinding (its own name made to resolve to 127.0.0.1), and then
`DELETE /api/studies/1` deleted the study. So every request must name this server in its `Host`,
and a write coming from a browser page must come from this server's own origin. It opens only
storages that already hold Optuna's tables, unless --create: Optuna would add its 13 tables to
any SQLite file it is given. Every probe fact is already a trial user attribute
(status, phase, peak per phase, s/step, verdict, error) and the objectives are named
(quality, seconds_per_sample), so the stock dashboard shows them as they are.
"""

from __future__ import annotations

import ipaddress
import signal
import socket
import socketserver
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from fitfinder.errors import UserError
from fitfinder.search.study import OPTUNA_TABLES, is_study_file


def storage_for(study_db: str | None, studies_dir: Path, create: bool = False) -> tuple[str, str]:
    """(storage URL, what to call it) for a studies/NAME.db file, a study NAME, a storage URL,
    or nothing: then the one study in `studies_dir`. Refuses a storage without Optuna's tables
    unless `create`."""
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
        _check_url(study_db, create)
        return study_db, study_db
    else:
        path = Path(study_db)
        if not path.exists() and (studies_dir / f"{study_db}.db").is_file():
            path = studies_dir / f"{study_db}.db"  # a bare study name
        if not path.is_file():
            here = ", ".join(p.name for p in sorted(studies_dir.glob("*.db"))) or "none"
            raise UserError(f"{study_db}: no such study file; studies in {studies_dir}/: {here}")
    if not create:
        _check_is_study_file(path)
    return f"sqlite:///{path.resolve()}", str(path)


_SQLITE = "sqlite:///"


def _check_url(url: str, create: bool) -> None:
    """A storage URL must already hold Optuna's tables, unless `create`."""
    if create:
        return
    if url.startswith(_SQLITE):
        path = Path(url[len(_SQLITE):].split("?")[0])
        if not path.is_file():
            raise UserError(f"{url}: no such file; give --create to make a new study storage there")
        _check_is_study_file(path, url)
        return
    try:
        import sqlalchemy

        engine = sqlalchemy.create_engine(url)
        try:
            inspector = sqlalchemy.inspect(engine)
            found = all(inspector.has_table(table) for table in OPTUNA_TABLES)
        finally:
            engine.dispose()
    except Exception as exc:  # a driver that is missing, a server that does not answer
        reason = (str(exc).splitlines() or ["-"])[0][:200]
        raise UserError(f"{url}: cannot open it ({type(exc).__name__}: {reason})") from None
    if not found:
        raise UserError(f"{url}: holds no Optuna study; give --create to add Optuna's tables to it")


def _check_is_study_file(path: Path, shown: str | None = None) -> None:
    """Refuse a file that is not an Optuna SQLite storage, before Optuna would add its tables to it."""
    if not is_study_file(path):
        raise UserError(f"{shown or path}: not an Optuna study database (made by `fitfinder search`); "
                        "give --create to add Optuna's tables to it")


WRITES = ("POST", "PUT", "PATCH", "DELETE")


class LocalGuard:
    """WSGI middleware: a request must name this server in its Host header (a DNS-rebinding page
    names its own domain), and a write from a browser must carry this server's own Origin (a
    browser sends one with every cross-origin write; a missing Origin is a client such as curl)."""

    def __init__(self, app, host: str, port: int = 0):
        self.app, self.host, self.port = app, host, port

    def __call__(self, environ, start_response):
        host = environ.get("HTTP_HOST", "")
        if not self.host_ok(host):
            return _forbidden(start_response, f"Host {host[:100]!r} is not this dashboard's address")
        origin = environ.get("HTTP_ORIGIN")
        if environ.get("REQUEST_METHOD", "GET").upper() in WRITES and origin is not None \
                and origin.lower() != f"http://{host.lower()}":
            return _forbidden(start_response, f"Origin {origin[:100]!r} may not change this dashboard's studies")
        return self.app(environ, start_response)

    def host_ok(self, header: str) -> bool:
        """`name:port` with this server's port, and a name it answers to: its address; for a
        loopback one `localhost` and loopback addresses; for 0.0.0.0 any IP address and this
        machine's own names (never a domain, which a rebinding page controls)."""
        name, port = _split_host(header)
        if port != str(self.port):
            return False
        bound = self.host.lower().strip("[]")
        if name == bound:
            return True
        if _loopback(bound):
            return _loopback(name)
        if bound in ("0.0.0.0", "::", ""):
            return _is_ip(name) or name in ("localhost", socket.gethostname().lower(), socket.getfqdn().lower())
        return False


def _split_host(header: str) -> tuple[str, str]:
    """('::1', '8080') from '[::1]:8080'; the port is 80 when the header names none."""
    header = header.strip().lower()
    if header.startswith("["):
        name, _, rest = header[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        name, _, port = header.partition(":")
    return name, port or "80"


def _loopback(host: str) -> bool:
    return host == "localhost" or _is_ip(host) and ipaddress.ip_address(host).is_loopback


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _forbidden(start_response, why: str) -> list[bytes]:
    body = f"fitfinder dashboard: refused: {why}\n".encode("utf-8", "backslashreplace")
    start_response("403 Forbidden", [("Content-Type", "text/plain; charset=utf-8"),
                                     ("Content-Length", str(len(body)))])
    return [body]


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
                            f"{(str(exc).splitlines() or ['-'])[0][:200]})") from None
        guard = LocalGuard(optuna_dashboard.wsgi(self.storage), host)
        try:
            self.server = make_server(host, port, guard, server_class=_Server, handler_class=_QuietHandler)
        except OSError as exc:
            raise UserError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc}); "
                            "pick another port with --port, or --port 0 for any free one") from None
        self.host, self.port = host, self.server.server_address[1]
        guard.port = self.port  # known only now when --port 0 picked one

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
