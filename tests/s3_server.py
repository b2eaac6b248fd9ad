"""moto's standalone S3 server on 127.0.0.1 for tests: its own process group, stopped by PID."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import _wait_http, free_port, stop_pid

#: Credentials moto accepts; the region keeps botocore from looking for a config file.
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class S3Server:
    """`python -m moto.server` on a free 127.0.0.1 port; `env()` points s3fs (botocore) at it."""

    def __init__(self, root: Path, port: int | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.log = self.root / "moto.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """What a process needs to reach this server through s3fs.

        botocore reads AWS_ENDPOINT_URL_S3 whenever a client is created (s3fs 2026.9 has no endpoint
        variable of its own); FSSPEC_S3_ENDPOINT_URL is read by fsspec at import, for processes started later.
        """
        return {**AWS_ENV, "AWS_ENDPOINT_URL_S3": self.endpoint, "FSSPEC_S3_ENDPOINT_URL": self.endpoint}

    def start(self, timeout: float = 60) -> S3Server:
        cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        env = {**os.environ, **AWS_ENV}
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self.log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True
        )
        _wait_http(f"{self.endpoint}/moto-api/", self.proc, timeout, self.log)
        return self

    def stop(self) -> None:
        stop_pid(self.proc)
        self.proc = None

    def new_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh random name unless given) through the server; returns its name."""
        import s3fs

        name = name or f"rbs-{uuid.uuid4().hex[:10]}"
        fs = s3fs.S3FileSystem(
            key="testing", secret="testing", endpoint_url=self.endpoint, skip_instance_cache=True
        )
        fs.mkdir(name)
        return name

    def requests(self) -> list[str]:
        """The request lines the server logged so far, e.g. `PUT /bucket/key`, in the order it answered them."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            if '"' in line and " HTTP/" in line:
                method, _, rest = line.split('"', 2)[1].partition(" ")
                out.append(f"{method} {rest.rsplit(' HTTP/', 1)[0]}")
        return out


def forget_s3_clients() -> None:
    """s3fs caches file systems (and their endpoint) per process; a new server needs new ones."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


#: The bucket the s3 test policies name (tests/data/policies/spot-s3.yaml).
POLICY_BUCKET = "rollback-tests"


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A moto S3 server for one test module, with this process's (and its children's) env pointed at it."""
    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    try:
        server.new_bucket(POLICY_BUCKET)
        with pytest.MonkeyPatch.context() as mp:
            for key, value in server.env().items():
                mp.setenv(key, value)
            forget_s3_clients()
            yield server
    finally:
        forget_s3_clients()
        server.stop()
