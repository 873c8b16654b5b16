"""Which S3 client for the prefix store: boto3 vs obstore vs s3fs, against moto's server on loopback.

What the store does per request: a conditional create (If-None-Match: *) of a ~0.5 MB block object,
a whole-object GET, a ranged GET (64 KiB), a HEAD, and a LIST of one prefix.  Each operation is timed
per client with warm-up, arms interleaved in rotating order, medians reported (ms).  Also records
whether each client can express the conditional create the store's atomic publish depends on.

    .venv/bin/python tools/bench_s3_clients.py [--reps 40] [--out tools/results/s3-clients.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid


def start_moto():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


class Boto3Arm:
    name = "boto3"

    def __init__(self, endpoint, bucket):
        import boto3

        self.c = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                              aws_access_key_id="test", aws_secret_access_key="test")
        self.b = bucket

    def create(self, key, data):
        try:
            self.c.put_object(Bucket=self.b, Key=key, Body=data, IfNoneMatch="*")
            return True
        except self.c.exceptions.ClientError as e:
            if e.response["Error"]["Code"] in ("PreconditionFailed", "412"):
                return False
            raise

    def get(self, key):
        return self.c.get_object(Bucket=self.b, Key=key)["Body"].read()

    def get_range(self, key, off, n):
        return self.c.get_object(Bucket=self.b, Key=key, Range=f"bytes={off}-{off + n - 1}")["Body"].read()

    def head(self, key):
        return self.c.head_object(Bucket=self.b, Key=key)["ContentLength"]

    def ls(self, prefix):
        return [o["Key"] for o in self.c.list_objects_v2(Bucket=self.b, Prefix=prefix).get("Contents", [])]


class ObstoreArm:
    name = "obstore"

    def __init__(self, endpoint, bucket):
        from obstore.store import S3Store

        self.s = S3Store(bucket, endpoint=endpoint, region="us-east-1", access_key_id="test",
                         secret_access_key="test", client_options={"allow_http": True},
                         virtual_hosted_style_request=False)

    def create(self, key, data):
        import obstore

        try:
            obstore.put(self.s, key, data, mode="create")
            return True
        except obstore.exceptions.AlreadyExistsError:
            return False

    def get(self, key):
        import obstore

        return bytes(obstore.get(self.s, key).bytes())

    def get_range(self, key, off, n):
        import obstore

        return bytes(obstore.get_range(self.s, key, start=off, end=off + n))

    def head(self, key):
        import obstore

        return obstore.head(self.s, key)["size"]

    def ls(self, prefix):
        import obstore

        return [o["path"] for batch in obstore.list(self.s, prefix) for o in batch]


class S3fsArm:
    name = "s3fs"

    def __init__(self, endpoint, bucket):
        import s3fs

        self.fs = s3fs.S3FileSystem(key="test", secret="test", client_kwargs={"endpoint_url": endpoint,
                                                                             "region_name": "us-east-1"})
        self.b = bucket

    def create(self, key, data):  # s3fs has no conditional create: exists() then put is a race
        p = f"{self.b}/{key}"
        if self.fs.exists(p):
            return False
        with self.fs.open(p, "wb") as f:
            f.write(data)
        return True

    def get(self, key):
        return self.fs.cat(f"{self.b}/{key}")

    def get_range(self, key, off, n):
        with self.fs.open(f"{self.b}/{key}", "rb", block_size=n) as f:
            f.seek(off)
            return f.read(n)

    def head(self, key):
        self.fs.invalidate_cache()
        return self.fs.info(f"{self.b}/{key}")["size"]

    def ls(self, prefix):
        self.fs.invalidate_cache()
        return self.fs.ls(f"{self.b}/{prefix}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--size", type=int, default=576 * 1024, help="object size (a 64-token SmolLM2 block at 4+2)")
    ap.add_argument("--out", default="tools/results/s3-clients.md")
    a = ap.parse_args()
    server, endpoint = start_moto()
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test",
                 aws_secret_access_key="test").create_bucket(Bucket="bench")
    arms = []
    for cls in (Boto3Arm, ObstoreArm, S3fsArm):
        try:
            arms.append(cls(endpoint, "bench"))
        except Exception as e:  # noqa: BLE001 - a client that is not installed is reported, not fatal
            print(f"{cls.name}: unavailable ({type(e).__name__}: {e})")
    payloads = [os.urandom(a.size) for _ in range(4)]
    for i in range(20):
        arms[0].create(f"ls/{i:03d}", b"x")
    arms[0].create("obj", payloads[0])
    ops = {
        "create (If-None-Match)": lambda arm, r: arm.create(f"new/{arm.name}/{uuid.uuid4().hex}", payloads[r % 4]),
        "create existing -> refused": lambda arm, r: arm.create("obj", payloads[0]),
        "GET whole": lambda arm, r: arm.get("obj"),
        "GET range 64 KiB": lambda arm, r: arm.get_range("obj", (r % 8) * 65536, 65536),
        "HEAD": lambda arm, r: arm.head("obj"),
        "LIST 20 keys": lambda arm, r: arm.ls("ls/"),
    }
    checks = {arm.name: (arm.create("obj", payloads[0]) is False and arm.get("obj") == payloads[0]
                         and arm.get_range("obj", 100, 50) == payloads[0][100:150]) for arm in arms}
    times = {(arm.name, op): [] for arm in arms for op in ops}
    for r in range(a.reps + 3):  # 3 warm-up rounds
        for j in range(len(arms)):
            arm = arms[(r + j) % len(arms)]  # rotate the order of the arms
            for op, fn in ops.items():
                t0 = time.perf_counter()
                fn(arm, r)
                if r >= 3:
                    times[(arm.name, op)].append(1e3 * (time.perf_counter() - t0))
    server.stop()
    lines = ["# S3 clients against moto (loopback), median ms per call", "",
             f"{a.reps} rounds after 3 warm-up rounds; arms interleaved in rotating order; object {a.size:,} B.", "",
             "| operation | " + " | ".join(arm.name for arm in arms) + " |",
             "|---|" + "---|" * len(arms)]
    for op in ops:
        lines.append(f"| {op} | " + " | ".join(f"{statistics.median(times[(arm.name, op)]):.2f}" for arm in arms) + " |")
    lines.append("| results correct | " + " | ".join("yes" if checks[arm.name] else "NO" for arm in arms) + " |")
    lines.append("")
    lines.append("s3fs: no conditional create (exists() then write races); obstore: put(mode='create'); "
                 "boto3: put_object(IfNoneMatch='*').")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
