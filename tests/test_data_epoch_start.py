"""Epoch starts at scale: the same data workers all run, one credential look-up each, spread shard opens.

The multi-rank test runs 2 ranks x 8 workers for 2 epochs over a loopback S3 behind a proxy that
answers 503 SlowDown past a request rate (support/s3_fault_proxy.py), with credentials from a
fake instance metadata service that throttles too (support/fake_imds.py; no keys in the
environment, so every look-up is a real botocore IMDSv2 look-up, counted). Per epoch it counts
the shard GETs and the credential look-ups, and checks every sample of every epoch was read
exactly once (the loader's own accounting, and the keys) and that both epochs ran on the same
worker processes.
"""

from __future__ import annotations

import glob
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.request import urlopen

import pytest
import torch.distributed as dist
from support.fake_imds import CHAIN_VARIABLES, FakeIMDS
from support.s3_fault_proxy import FaultProxy
from test_data_common import IMAGE_SIZE, TOKENIZER, data_config, valid_keys, write_dataset

from bigclip.data.open_schedule import OPEN_RATE, open_delays
from bigclip.demo.loopback_s3 import LoopbackS3
from bigclip.distributed import spawn

BUCKET = "bigclip-epoch-start"
SIZES = [4] * 32  # 2 shards per reader at 2 ranks x 8 workers
WORKERS, RANKS, EPOCHS = 8, 2, 2
S3_RATE, S3_BURST = 40.0, 10.0  # GETs a second per prefix the proxy allows (S3's 5,500, scaled down)
OPEN_RATE_HERE = S3_RATE / 2  # the loaders' first opens, kept below it
REFUSED = 6  # first shard GETs and first IMDS calls answered "slow down", however slowly they come


class Probe:
    """Answers GET with the JSON of `report()`: how the ranks read this process's counters."""

    def __init__(self, report) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                body = json.dumps(report()).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def epochs_on_one_pool(rank: int, world_size: int, pattern: str, probe: str) -> dict:
    from bigclip.data.train_data import TrainData

    def counters() -> dict | None:  # once every rank is between epochs
        dist.barrier()
        seen = json.load(urlopen(probe)) if rank == 0 else None
        dist.barrier()
        return seen

    cfg = data_config(pattern, workers=WORKERS, batch_size=2, shard_interleave=2)
    out: dict = {"counters": [counters()], "keys": [], "pids": [], "accounts": []}
    with TrainData(cfg, rank=rank, world_size=world_size, seed=3, image_size=IMAGE_SIZE, tokenizer=TOKENIZER,
                   open_rate=OPEN_RATE_HERE) as data:  # fmt: skip
        for epoch in range(EPOCHS):
            loader = data.epoch(epoch)
            out["keys"].append([key for batch in loader for key in batch.keys])
            account = loader.account_epoch()
            out["accounts"].append((account.samples, account.clean, account.broken))
            out["pids"].append(data.worker_pids)
            out["counters"].append(counters())
    return out


@pytest.fixture
def throttled_s3_and_imds(tmp_path, monkeypatch):
    """(shard pattern, proxy, imds): shards in a loopback S3 behind a throttle, keys only from the IMDS."""
    write_dataset(str(tmp_path / "shards"), SIZES)
    with LoopbackS3() as s3, FaultProxy(upstream=s3.endpoint) as proxy, FakeIMDS() as imds:
        s3.create_bucket(BUCKET)
        client = s3.client()
        for path in glob.glob(str(tmp_path / "shards" / "*")):
            client.upload_file(path, BUCKET, f"train/{os.path.basename(path)}")
        for name in CHAIN_VARIABLES:
            monkeypatch.delenv(name, raising=False)
        (tmp_path / "aws-config").write_text("")
        for name, value in imds.env(str(tmp_path / "aws-config")).items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        proxy.throttle(rate=S3_RATE, burst=S3_BURST)
        proxy.add_rule("slowdown", method="GET", path_contains="/train/0", times=REFUSED)  # whatever the pace
        imds.throttle(rate=20, burst=4)
        imds.refuse(REFUSED)  # the first look-ups are throttled, whatever the pace: they must back off
        yield f"s3://{BUCKET}/train/{{00000..{len(SIZES) - 1:05d}}}.tar", proxy, imds


@pytest.mark.dist
def test_epochs_share_workers_one_lookup_each_and_lose_no_shard(throttled_s3_and_imds):
    pattern, proxy, imds = throttled_s3_and_imds

    def report() -> dict:
        return {
            "gets": proxy.tally(method="GET", prefix_contains="/train"),
            "slowdowns": sum(n for prefix, n in proxy.throttled.items() if "/train" in prefix)
            + proxy.injected["slowdown"],
            "lookups": imds.lookups,
        }

    probe = Probe(report)
    try:
        ranks = spawn(epochs_on_one_pool, RANKS, pattern, probe.url, timeout_s=300)
    finally:
        probe.close()
    counters = ranks[0]["counters"]
    per_epoch = [{k: after[k] - before[k] for k in after} for before, after in zip(counters, counters[1:])]
    # One credential look-up per worker process for the whole run (and rank 0's, which lists the
    # shards), none at the next epoch: the workers are the same processes (same pids).
    assert [e["lookups"] for e in per_epoch] == [RANKS * WORKERS + 1, 0]
    assert imds.throttled >= REFUSED  # ...though the service said "too many requests" on the way
    for r in ranks:
        assert len(r["pids"][0]) == WORKERS and r["pids"][1] == r["pids"][0]
    # One GET per shard per epoch, retried where the proxy said SlowDown; once, rank 0's sizes.json
    # and its start-up read of the first shard's first samples (validation.check_sample_keys).
    assert [e["gets"] - e["slowdowns"] for e in per_epoch] == [len(SIZES) + 2, len(SIZES)]
    assert per_epoch[0]["slowdowns"] >= REFUSED
    for epoch in range(EPOCHS):  # every sample of every epoch exactly once
        keys = [k for r in ranks for k in r["keys"][epoch]]
        assert len(keys) == len(set(keys)) and set(keys) == valid_keys(SIZES)
        assert all(r["accounts"][epoch] == (sum(SIZES), True, []) for r in ranks)


def test_the_first_opens_of_an_epoch_keep_to_the_open_rate():
    """At 1024 ranks x 8 workers x interleave 4, every second of the spread holds at most its rate."""
    world, readers, interleave = 1024, 8, 4
    starts = [
        delay
        for rank in range(world)
        for delay in open_delays(
            rank=rank, world_size=world, readers=readers, interleave=interleave, rate=OPEN_RATE
        )
    ]
    spread = world * readers * interleave / OPEN_RATE
    assert max(starts) < spread
    per_second = [0] * (int(spread) + 1)
    for start in starts:
        per_second[int(start)] += interleave  # a reader opens its shards as it starts
    assert max(per_second) <= OPEN_RATE + interleave
    # The first reader of every rank (what the first step needs) starts within 1 / readers of the spread.
    firsts = [open_delays(rank=r, world_size=world, readers=readers, interleave=interleave, rate=OPEN_RATE)[0]
              for r in range(world)]  # fmt: skip
    assert max(firsts) < spread / readers
    assert open_delays(rank=3, world_size=4, readers=2, interleave=2, rate=None) == [0.0, 0.0]


def imds_request(endpoint: str):
    import botocore.awsrequest

    request = botocore.awsrequest.AWSRequest(
        method="PUT",
        url=f"{endpoint}/latest/api/token",
        headers={"x-aws-ec2-metadata-token-ttl-seconds": "60"},
    )
    return request.prepare()


def test_metadata_requests_back_off_while_throttled_and_not_when_nothing_answers():
    from botocore.exceptions import EndpointConnectionError
    from botocore.httpsession import URLLib3Session

    from bigclip.distributed import free_port
    from bigclip.storage.s3_credentials import BackoffSend

    pauses: list[float] = []
    with FakeIMDS() as imds:
        imds.refuse(3)
        send = BackoffSend(URLLib3Session(timeout=5).send, sleep=pauses.append)
        assert send(imds_request(imds.endpoint)).status_code == 200
        assert imds.throttled == 3 and len(pauses) == 3  # full jitter under a doubling cap
        assert all(0 <= p <= cap for p, cap in zip(pauses, (0.25, 0.5, 1.0)))
        imds.refuse(100)
        assert send(imds_request(imds.endpoint)).status_code == 429  # gives up after its tries
        assert len(pauses) == 3 + send.tries - 1
    pauses.clear()
    with pytest.raises(EndpointConnectionError):  # nothing listens (not on EC2): no retry, no pause
        send(imds_request(f"http://127.0.0.1:{free_port()}"))
    assert pauses == []
