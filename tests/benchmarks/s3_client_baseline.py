"""The plain S3 client baseline (issue 15): PUT and GET of N bytes with no tannery in between.

Issue 15 asks a replica to Store and Fetch a 1 GiB archive at no less than 0.7x "a plain S3
client putting and getting the same bytes to the same SeaweedFS"; :func:`baseline` is that
client (boto3: a multipart upload by s3transfer, then parallel ranged GETs into one buffer).
A later benchmark case calls it beside tannery, in one run.

Run as a script it also compares the two candidate libraries, boto3 and obstore, side by
side against one SeaweedFS (that comparison chose boto3; ``docs/benchmarks.md``, "S3 blob store"):

    python -m tests.benchmarks.s3_client_baseline --sizes 256MiB 1GiB --reps 3 [--compare]

Without ``AWS_ENDPOINT_URL_S3`` it starts its own SeaweedFS (tests/s3_harness.py).
``--compare`` needs obstore, which no extra installs (``pip install obstore==0.12.1``, the
version measured): the comparison is run by hand when the choice is revisited.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

MiB = 1 << 20
GiB = 1 << 30
#: Part and range size, and requests in flight, for every client measured here.
PART = 16 * MiB
CONCURRENCY = 8


def boto3_client(env: dict[str, str] | None = None, pool: int = 16):
    """A boto3 S3 client from the AWS_* variables (``env`` or the process's)."""
    import boto3
    from botocore.config import Config

    env = dict(os.environ if env is None else env)
    return boto3.session.Session().client(
        "s3", endpoint_url=env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"),
        aws_access_key_id=env.get("AWS_ACCESS_KEY_ID"), aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
        region_name=env.get("AWS_REGION") or "us-east-1",
        config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard"}, max_pool_connections=pool,
                      request_checksum_calculation="when_required", response_checksum_validation="when_required"),
    )


class _Reader:
    """A read-only file over a buffer (s3transfer reads parts from a file; BytesIO would copy it all)."""

    def __init__(self, data: memoryview) -> None:
        self._data, self._at = data, 0

    def read(self, size: int = -1) -> bytes:
        stop = len(self._data) if size < 0 else min(len(self._data), self._at + size)
        piece = bytes(self._data[self._at:stop])
        self._at = stop
        return piece

    def seek(self, offset: int, whence: int = 0) -> int:
        self._at = offset if whence == 0 else (self._at + offset if whence == 1 else len(self._data) + offset)
        return self._at

    def tell(self) -> int:
        return self._at


def boto3_put(client, bucket: str, key: str, data: memoryview) -> None:
    from boto3.s3.transfer import TransferConfig

    config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=CONCURRENCY)
    client.upload_fileobj(_Reader(data), bucket, key, Config=config)


def boto3_get(client, bucket: str, key: str, size: int) -> bytearray:
    """Parallel ranged GETs, each read straight into its slice of one buffer."""
    buffer = bytearray(size)
    view = memoryview(buffer)

    def fetch(start: int) -> None:
        stop = min(size, start + PART)
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{stop - 1}")["Body"]
        at = start
        while at < stop:
            got = body.readinto(view[at:stop])
            if not got:
                raise EOFError(f"{key}: short range at {at}")
            at += got

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(fetch, range(0, size, PART)))
    return buffer


def obstore_store(bucket: str, env: dict[str, str] | None = None):
    from obstore.store import S3Store

    env = dict(os.environ if env is None else env)
    return S3Store(bucket, endpoint=env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"),
                   access_key_id=env.get("AWS_ACCESS_KEY_ID"), secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
                   region=env.get("AWS_REGION") or "us-east-1", client_options={"allow_http": True})


def obstore_put(store, key: str, data: memoryview) -> None:
    import obstore

    obstore.put(store, key, data, use_multipart=True, chunk_size=PART, max_concurrency=CONCURRENCY)


def obstore_get(store, key: str, size: int) -> bytearray:
    """Parallel ranged GETs, each copied into its slice of one buffer (obstore returns its own bytes)."""
    import obstore

    buffer = bytearray(size)
    view = memoryview(buffer)

    def fetch(start: int) -> None:
        stop = min(size, start + PART)
        view[start:stop] = memoryview(obstore.get_range(store, key, start=start, end=stop))

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(fetch, range(0, size, PART)))
    return buffer


def _timed(action: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    result = action()
    return time.perf_counter() - started, result


def baseline(nbytes: int, bucket: str, env: dict[str, str] | None = None, data: memoryview | None = None) -> dict:
    """PUT then GET ``nbytes`` (random unless ``data``) with plain boto3; seconds of each, and GiB/s."""
    client = boto3_client(env)
    data = data if data is not None else memoryview(os.urandom(nbytes))
    key = f"baseline/{uuid.uuid4().hex}"
    put_s, _ = _timed(lambda: boto3_put(client, bucket, key, data))
    get_s, got = _timed(lambda: boto3_get(client, bucket, key, nbytes))
    if got != data:
        raise AssertionError("baseline: the bytes read back differ from those written")
    client.delete_object(Bucket=bucket, Key=key)
    return {"bytes": nbytes, "put_s": put_s, "get_s": get_s,
            "put_gib_s": nbytes / GiB / put_s, "get_gib_s": nbytes / GiB / get_s}


def compare(sizes: list[int], reps: int, bucket: str, env: dict[str, str]) -> list[dict]:
    """boto3 and obstore alternating (the order rotated each repetition); median seconds."""
    client, store = boto3_client(env), obstore_store(bucket, env)
    competitors = {
        "boto3": (lambda k, d: boto3_put(client, bucket, k, d), lambda k, n: boto3_get(client, bucket, k, n)),
        "obstore": (lambda k, d: obstore_put(store, k, d), lambda k, n: obstore_get(store, k, n)),
    }
    rows = []
    for size in sizes:
        data = memoryview(os.urandom(size))
        samples: dict[str, dict[str, list[float]]] = {name: {"put": [], "get": []} for name in competitors}
        for rep in range(reps):
            names = list(competitors)
            names = names[rep % len(names):] + names[:rep % len(names)]
            for name in names:
                put, get = competitors[name]
                key = f"compare/{name}/{uuid.uuid4().hex}"
                put_s, _ = _timed(lambda: put(key, data))
                get_s, got = _timed(lambda: get(key, size))
                if got != data:
                    raise AssertionError(f"{name}: the bytes read back differ")
                client.delete_object(Bucket=bucket, Key=key)
                samples[name]["put"].append(put_s)
                samples[name]["get"].append(get_s)
        for name, times in samples.items():
            rows.append({"client": name, "bytes": size, "put_s": statistics.median(times["put"]),
                         "get_s": statistics.median(times["get"]), "put_spread": max(times["put"]) - min(times["put"]),
                         "get_spread": max(times["get"]) - min(times["get"])})
    return rows


def _size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": MiB, "GiB": GiB}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=_size, default=[256 * MiB, GiB])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--compare", action="store_true", help="boto3 and obstore side by side")
    parser.add_argument("--bucket", default="tannery-baseline")
    args = parser.parse_args(argv)
    seaweed = None
    env = dict(os.environ)
    if not (env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")):
        from tests.s3_harness import SeaweedFS

        seaweed = SeaweedFS()
        env.update(seaweed.env())
    try:
        client = boto3_client(env)
        try:
            client.create_bucket(Bucket=args.bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        if args.compare:
            print("| client | size | PUT median (spread) | PUT GiB/s | GET median (spread) | GET GiB/s |")
            print("|---|---|---|---|---|---|")
            for row in compare(args.sizes, args.reps, args.bucket, env):
                gib = row["bytes"] / GiB
                print(f"| {row['client']} | {row['bytes'] // MiB} MiB | {row['put_s']:.2f} s ({row['put_spread']:.2f}) "
                      f"| {gib / row['put_s']:.2f} | {row['get_s']:.2f} s ({row['get_spread']:.2f}) "
                      f"| {gib / row['get_s']:.2f} |")
        else:
            for size in args.sizes:
                result = baseline(size, args.bucket, env)
                print(f"{size // MiB} MiB: PUT {result['put_s']:.2f} s ({result['put_gib_s']:.2f} GiB/s), "
                      f"GET {result['get_s']:.2f} s ({result['get_gib_s']:.2f} GiB/s)")
    finally:
        if seaweed is not None:
            seaweed.close()


if __name__ == "__main__":
    main()
