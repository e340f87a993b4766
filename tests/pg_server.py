"""A real PostgreSQL server for the tests: initdb into a temporary folder, listening on a Unix socket
only (no TCP port), run as an unprivileged user when the tests run as root (PostgreSQL refuses
root), stopped and removed at the end of the session. fsync is off for the tests (PgServer(fsync=True)
for benchmarks): a test server (no test cuts its power; durability of acknowledged rows is the
server's, tested by PostgreSQL itself).

The server binaries come from Debian's `postgresql` package (`make system-deps` installs it):
/usr/lib/postgresql/<version>/bin is not on PATH there, so it is searched as well.
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

USER = "kvbatch"  # the server's superuser (trust auth over its own socket only)


def find_bindir() -> Optional[Path]:
    """The folder holding initdb and pg_ctl (the newest version), or None when none is installed."""
    on_path = shutil.which("initdb")
    candidates = ([str(Path(on_path).resolve().parent)] if on_path else []) + sorted(
        glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name)
        if Path(p).parent.name.isdigit() else 0, reverse=True) + sorted(
        glob.glob("/opt/homebrew/opt/postgresql*/bin") + glob.glob("/usr/local/opt/postgresql*/bin"))
    for d in candidates:
        if (Path(d) / "initdb").exists() and (Path(d) / "pg_ctl").exists():
            return Path(d)
    return None


def _run_as() -> Optional[pwd.struct_passwd]:
    """The unprivileged account to run the server as when we are root (None: run as ourselves)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError("running as root and neither a 'postgres' nor a 'nobody' user exists to run PostgreSQL")


class PgServer:
    def __init__(self, bindir: Path, fsync: bool = False):
        self.bindir, self.fsync = bindir, fsync
        self.user = _run_as()
        self.root = Path(tempfile.mkdtemp(prefix="kvbatch-pg-"))
        self.data, self.sock = self.root / "data", self.root / "sock"
        self.sock.mkdir()
        if self.user is not None:
            for p in (self.root, self.sock):
                os.chown(p, self.user.pw_uid, self.user.pw_gid)
        self.started = False

    def _cmd(self, *args: str) -> subprocess.CompletedProcess:
        kw = {}
        if self.user is not None:
            kw = {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}
        env = {**os.environ, "HOME": str(self.root), "LC_ALL": "C"}
        return subprocess.run([str(self.bindir / args[0]), *args[1:]], capture_output=True, text=True,
                              cwd=self.root, env=env, timeout=120, **kw)

    def start(self) -> "PgServer":
        r = self._cmd("initdb", "-D", str(self.data), "-U", USER, "--auth=trust", "-E", "UTF8", "--no-sync")
        if r.returncode:
            raise RuntimeError(f"initdb failed: {r.stderr or r.stdout}")
        opts = f"-k {self.sock} -c listen_addresses='' -c max_connections=200"
        if not self.fsync:  # the tests' server (benchmarks keep PostgreSQL's durable defaults)
            opts += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        r = self._cmd("pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"), "-o", opts, "-w", "start")
        if r.returncode:
            log = (self.root / "log").read_text() if (self.root / "log").exists() else ""
            raise RuntimeError(f"pg_ctl start failed: {r.stderr or r.stdout}\n{log[-2000:]}")
        self.started = True
        return self

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://{USER}@/{db}?host={self.sock}"

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        if self.started:
            self._cmd("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
            self.started = False
        shutil.rmtree(self.root, ignore_errors=True)
