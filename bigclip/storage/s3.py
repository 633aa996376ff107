"""S3 addressing shared by data loading, checkpoints and remote sync.

One place decides the endpoint, region and addressing style, so a loopback S3 server
(tests, `make demo`) and S3-compatible stores work everywhere once `AWS_ENDPOINT_URL`
(or `--s3-endpoint`) is set. Credentials always come from the standard AWS chain
(environment, shared config, instance role); bigclip never stores them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from bigclip.errors import StorageError

S3_SCHEME = "s3://"


def is_s3(uri: str) -> bool:
    return uri.startswith(S3_SCHEME)


def split_s3_uri(uri: str) -> tuple[str, str]:
    """'s3://bucket/a/b' -> ('bucket', 'a/b')."""
    if not is_s3(uri):
        raise StorageError(f"not an s3:// URI: {uri!r}")
    bucket, _, key = uri[len(S3_SCHEME) :].partition("/")
    if len(bucket) < 3:
        raise StorageError(f"{uri!r}: S3 bucket names have at least 3 characters")
    return bucket, key


def join_s3_uri(bucket: str, key: str) -> str:
    return f"{S3_SCHEME}{bucket}/{key.lstrip('/')}"


@dataclass(frozen=True)
class S3Settings:
    """Endpoint and region. `endpoint=None` means AWS itself (virtual-hosted addressing)."""

    region: str
    endpoint: str | None = None

    @classmethod
    def resolve(cls, *, endpoint: str = "", region: str = "") -> S3Settings:
        """Explicit values win, then AWS_ENDPOINT_URL(_S3) / AWS_REGION / AWS_DEFAULT_REGION."""
        endpoint = (
            endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        )
        region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or ""
        if not region:
            region = _region_from_aws_config() or "us-east-1"
        return cls(region=region, endpoint=endpoint)

    @property
    def path_style(self) -> bool:
        # S3-compatible stores (MinIO, moto, Ceph) generally need path-style addressing.
        return self.endpoint is not None

    def boto3_client(self):
        import boto3
        from botocore.config import Config

        config = Config(
            s3={"addressing_style": "path" if self.path_style else "auto"},
            retries={"max_attempts": 10, "mode": "adaptive"},
        )
        return boto3.client("s3", region_name=self.region, endpoint_url=self.endpoint, config=config)

    def s3torch_client_config(self):
        from s3torchconnector import S3ClientConfig

        return S3ClientConfig(force_path_style=self.path_style)

    def s3torch_client(self):
        from s3torchconnector._s3client import S3Client

        return S3Client(self.region, endpoint=self.endpoint, s3client_config=self.s3torch_client_config())


def _region_from_aws_config() -> str | None:
    try:
        import botocore.session

        return botocore.session.get_session().get_config_variable("region")
    except Exception:  # no botocore config at all: fall back to the default region
        return None
