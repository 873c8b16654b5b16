"""Shared by the prefix-store tests and their writer processes: a tiny random-weight llama (the same
weights in every process), prompts with shared prefixes, and a moto S3 server on loopback."""

from __future__ import annotations

import json
import os
import sys

import numpy as np

VOCAB = 500


def tiny_model(layers: int = 3):
    import mlx.core as mx
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=layers, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
                           head_dim=32, tie_word_embeddings=True)
    mx.random.seed(1234)  # same weights, hence the same fingerprint and namespace, in every process
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def kv_cache(model, toks):
    from mlx_lm.models.cache import make_prompt_cache

    from rvqstore.generation import prefill

    c = make_prompt_cache(model)
    prefill(model, toks, c)
    return c


def record_pool_sizes(monkeypatch) -> list:
    """The thread counts PrefixStore's pools ask for, appended as they are made (the pools still run)."""
    from concurrent.futures import ThreadPoolExecutor

    from rvqstore.store import prefix_store

    sizes = []

    def pool(max_workers=None, *a, **kw):
        sizes.append(max_workers)
        return ThreadPoolExecutor(max_workers, *a, **kw)

    monkeypatch.setattr(prefix_store, "ThreadPoolExecutor", pool)
    return sizes


def start_moto():
    """A moto S3 server on 127.0.0.1 (a free port) and a bucket; returns (server, endpoint)."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    s3_client(endpoint).create_bucket(Bucket="rvq-test")
    return server, endpoint


def s3_client(endpoint):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test",
                        aws_secret_access_key="test")


S3_OPTS = dict(access_key_id="test", secret_access_key="test")


def _worker(spec: dict) -> None:
    """A writer process: put each prompt of ``spec["prompts"]`` (lists of [seed, n] parts, concatenated)
    into the store; ``delay`` seconds before each block is published; ``barrier`` [dir, n]: wait until
    n writers are ready."""
    import time

    from rvqstore.store import PrefixStore

    model = tiny_model()
    opts = dict(S3_OPTS, endpoint=spec["endpoint"]) if spec["url"].startswith("s3://") else {}
    store = PrefixStore(spec["url"], model=model, block_size=spec.get("block_size", 16), workers=1, **opts)
    if spec.get("delay"):
        create = store.backend.create

        def slow_create(path, data):
            time.sleep(spec["delay"])
            return create(path, data)

        store.backend.create = slow_create
    work = []
    for prompt in spec["prompts"]:
        toks = [t for seed, n in prompt for t in tokens(seed, n)]
        work.append((toks, kv_cache(model, toks)))
    if spec.get("barrier"):  # every writer ready before any publishes: a tight race
        d, n = spec["barrier"]
        open(os.path.join(d, f"ready-{os.getpid()}"), "w").close()
        deadline = time.time() + 120
        while len(os.listdir(d)) < n and time.time() < deadline:
            time.sleep(0.01)
    for toks, cache in work:
        r = store.put(toks, cache)
        print(json.dumps({"new_blocks": r.new_blocks, "stored_before": r.stored_before}), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _worker(json.loads(sys.argv[1]))
