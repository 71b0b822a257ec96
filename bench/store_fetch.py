"""LoadModel on a fresh replica, phase by phase, by where its bundle comes from: the Redis store, a shared
filesystem store, or the compile service (Compile hit + GetArtifact).

1. Makes a signing key pair, starts `kiln compile-server` on a fresh directory store and compiles the model once
   (cold; not timed here).
2. Copies that signed bundle into a Redis store (a redis-server started here on loopback, or --redis URL).
3. For each source, starts a fresh `kiln exec-server` (empty cache), times one LoadModel, prints its phases, stops it.

usage: python bench/store_fetch.py [--preset llama-3-8b] [--redis redis://HOST:PORT/DB]
"""

import argparse
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from kiln.client.channels import connect
from kiln.client.compile import compile_model
from kiln.client.load import load
from kiln.client.requests import compile_config, model_spec
from kiln.store.redis_store import RedisStore
from kiln.store.signing import PRIVATE_KEY_FILE, PUBLIC_KEY_FILE, generate_key_pair
from kiln_cli.service_process import ServiceProcess, child_environment, free_port, kiln_command
from protos import common_pb2, compile_pb2, compile_pb2_grpc, exec_pb2, exec_pb2_grpc

PHASES = ("fetch", "load_weights", "profile_memory", "load_compiled", "capture_cudagraphs", "total")


def service(name: str, tmp: Path, *argv: str) -> ServiceProcess:
    port = free_port()
    process = ServiceProcess(name, kiln_command(*argv[:1], "--host", "127.0.0.1", "--port", str(port), *argv[1:]),
                             f"127.0.0.1:{port}", tmp / f"{name}.log", child_environment())
    process.start()
    process.wait_healthy(timeout=600)
    return process


def load_once(tmp: Path, name: str, request: exec_pb2.LoadModelRequest, *exec_args: str) -> dict:
    """A fresh replica with an empty cache, one LoadModel; seconds per phase."""
    replica = service(f"exec-{name}", tmp, "exec-server", "--cache", str(tmp / f"cache-{name}"), "--trusted-keys",
                      str(tmp / "keys" / PUBLIC_KEY_FILE), *exec_args)
    try:
        phases, started = {}, time.perf_counter()

        def phase(p: exec_pb2.StartupPhase) -> None:
            if not p.progress:
                phases[p.phase] = p.seconds
                print(f"  {name:<16} {p.phase:<20} {p.seconds:7.2f}s  {p.detail}", flush=True)

        with connect(replica.address) as channel:
            load(exec_pb2_grpc.ExecServiceStub(channel), request, phase)
        phases["total"] = time.perf_counter() - started
        return phases
    finally:
        replica.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--redis", default="", help="a Redis to use (default: start redis-server on loopback)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="kiln-store-bench-") as name:
        tmp = Path(name)
        redis_process, url = None, args.redis
        if not url:
            port = free_port()
            redis_process = subprocess.Popen(
                [shutil.which("redis-server") or "redis-server", "--bind", "127.0.0.1", "--port", str(port),
                 "--dir", str(tmp), "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
            url = f"redis://127.0.0.1:{port}/0"
            time.sleep(0.5)
        generate_key_pair(tmp / "keys")
        compile_service = service("compile", tmp, "compile-server", "--store", str(tmp / "store"), "--signing-key",
                                  str(tmp / "keys" / PRIVATE_KEY_FILE))
        try:
            model = model_spec(args.preset)
            config = compile_config(args.device)
            with connect(compile_service.address) as channel:
                started = time.perf_counter()
                key = compile_model(compile_pb2_grpc.CompileServiceStub(channel),
                                    compile_pb2.CompileRequest(model=model, config=config)).key.digest
                print(f"compiled {args.preset} in {time.perf_counter() - started:.1f}s, key {key}", flush=True)

            redis_store = RedisStore(url, tmp / "redis-writer")
            with redis_store.lock(key):
                staged = redis_store.staging_dir()
                shutil.copytree(tmp / "store" / key, staged, dirs_exist_ok=True)
                (staged / ".last_used").unlink(missing_ok=True)
                started = time.perf_counter()
                redis_store.commit(key, staged)
                print(f"copied into {redis_store.location} in {time.perf_counter() - started:.2f}s", flush=True)

            by_key = exec_pb2.LoadModelRequest(name=args.preset, model=model, config=config,
                                               key=common_pb2.ArtifactKey(digest=key))
            by_spec = exec_pb2.LoadModelRequest(name=args.preset, model=model, config=config)
            results = {
                "redis store": load_once(tmp, "redis", by_key, "--store", url),
                "filesystem store": load_once(tmp, "filesystem", by_key, "--store", str(tmp / "store")),
                "compile service": load_once(tmp, "compile-service", by_spec, "--compile-server",
                                             compile_service.address),
            }
        finally:
            compile_service.stop()
            if redis_process is not None:
                redis_process.terminate()
                redis_process.wait()

    print(f"\nLoadModel of {args.preset} on a fresh replica (seconds)")
    print(f"| source | {' | '.join(PHASES)} |")
    print(f"|---|{'---:|' * len(PHASES)}")
    for source, phases in results.items():
        print(f"| {source} | " + " | ".join(f"{phases.get(p, 0.0):.2f}" for p in PHASES) + " |")


if __name__ == "__main__":
    main()
