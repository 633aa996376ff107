"""A loopback S3 endpoint for tests and `make demo`: moto's server on 127.0.0.1.

It runs as a separate process (so training processes and the server do not share a GIL),
on a free port, with dummy credentials; nothing leaves the machine.

    with LoopbackS3() as s3:          # sets AWS_ENDPOINT_URL and dummy credentials
        s3.create_bucket("bigclip-demo")
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from bigclip.distributed import free_port

DUMMY_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "bigclip-loopback",
    "AWS_SECRET_ACCESS_KEY": "bigclip-loopback-secret",
    "AWS_REGION": "us-east-1",
}


class LoopbackS3:
    def __init__(self, *, set_environ: bool = True) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.set_environ = set_environ
        self._proc: subprocess.Popen | None = None
        self._saved_env: dict[str, str | None] = {}

    @property
    def env(self) -> dict[str, str]:
        """Variables that point AWS clients (boto3, s3torchconnector, aws cli) at this server."""
        return {**DUMMY_CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def start(self) -> LoopbackS3:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait_until_listening(timeout_s=60)
        if self.set_environ:
            self._saved_env = {k: os.environ.get(k) for k in self.env}
            os.environ.update(self.env)
        return self

    def _wait_until_listening(self, *, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto server exited with code {self._proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"moto server did not listen on port {self.port} within {timeout_s}s")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=30)
            self._proc = None
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = {}

    def client(self):
        """A boto3 client for this server (credentials passed explicitly, environment untouched)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=DUMMY_CREDENTIALS["AWS_REGION"],
            aws_access_key_id=DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"

    def __enter__(self) -> LoopbackS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
