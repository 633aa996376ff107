"""The test harness's S3 throttle (support/s3_fault_proxy.py): 503 SlowDown past a rate per prefix.

The scale tests rest on it (a save's requests spread over prefixes commit where one prefix is
throttled), so it is checked against a real client: boto3 sees SlowDown on the busy prefix only,
and every request is counted by method and prefix.
"""

from __future__ import annotations

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from support.s3_fault_proxy import FaultProxy, TokenBucket, folder_of

from bigclip.demo.loopback_s3 import LoopbackS3


def test_token_bucket_allows_its_burst_then_its_rate() -> None:
    bucket = TokenBucket(rate=2.0, burst=3.0)
    assert [bucket.take(100.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.take(100.5)  # half a second refills one token at 2/s
    assert not bucket.take(100.5)


def test_folder_of_is_the_key_up_to_its_last_slash() -> None:
    assert folder_of("/bucket/run/step_1/ab/__0_0.distcp?partNumber=1") == "/bucket/run/step_1/ab"
    assert folder_of("/bucket") == "/bucket"


@pytest.mark.dist  # a moto server process beside the test
def test_throttle_answers_slowdown_per_prefix_and_counts_requests() -> None:
    with LoopbackS3() as s3, FaultProxy(upstream=s3.endpoint) as proxy:
        s3.create_bucket("throttled")
        client = boto3.client(
            "s3",
            endpoint_url=proxy.endpoint,
            config=Config(retries={"total_max_attempts": 1, "mode": "standard"}),
        )
        proxy.throttle(rate=0.001, burst=2)  # two requests per prefix, then SlowDown
        outcomes = []
        for key in ("hot/a", "hot/b", "hot/c", "cold/a"):
            try:
                client.put_object(Bucket="throttled", Key=key, Body=b"x")
                outcomes.append("ok")
            except ClientError as e:
                outcomes.append(e.response["Error"]["Code"])
        assert outcomes == ["ok", "ok", "SlowDown", "ok"]
        assert proxy.throttled == {"/throttled/hot": 1}
        assert proxy.tally(method="PUT", prefix_contains="/hot") == 3
        assert proxy.tally(method="PUT") == 4
