"""Start to ready: from `kiln exec-server` process start to a model's LoadModel ready, cold and warm.

1. The store: --store (a directory; its signing key pair beside it, as `kiln bench` keeps one) or a temporary one.
   Unless --key names a bundle, `kiln compile-server` compiles the model into it once (a hit when it is there
   already); that is not timed here.
2. Each run starts a fresh `python -m kiln_cli exec-server --store STORE` (read in place, no compile service) and
   sends one LoadModel (dummy weights) the moment it listens. "cold": new, empty TORCHINDUCTOR_CACHE_DIR,
   TRITON_CACHE_DIR and --cache directories, and the page cache dropped for the files the server reads (Python's
   library, site-packages with torch, triton and the CUDA libraries, this repository, the bundle), as far as an
   unprivileged process can (posix_fadvise DONTNEED: pages that another process maps stay). "warm": a second fresh
   process on the same directories.
3. Reported per run: process start -> listening (the imports; of them the runtime preload the server logs),
   LoadModel's phases and the steps inside them from its stream (fetch: find, verify, check; load_weights: build;
   profile_memory: forward, kv_cache; load_compiled: unpickle, warm_up, attention_warm_up; capture_cudagraphs),
   and start -> ready as the client saw it.

usage: python bench/start_to_ready.py [--preset llama-3-8b] [--device cuda] [--store DIR] [--runs cold,warm]
                                     [--piecewise-capture-sizes 0]   (without mixed graphs: what they add)
       python bench/start_to_ready.py --preset tiny-llama --device cpu   (a CPU smoke run)
"""

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as `python bench/start_to_ready.py` from anywhere

from kiln.client.channels import connect  # noqa: E402
from kiln.client.compile import compile_model  # noqa: E402
from kiln.client.load import load  # noqa: E402
from kiln.client.requests import compile_config  # noqa: E402
from kiln.rpc.grpc_server import CHANNEL_OPTIONS  # noqa: E402
from kiln.store.signing import PRIVATE_KEY_FILE, PUBLIC_KEY_FILE, generate_key_pair, local_keys_dir  # noqa: E402
from kiln_cli.service_process import ServiceProcess, child_environment, free_port, kiln_command  # noqa: E402
from protos import common_pb2, compile_pb2, compile_pb2_grpc, exec_pb2, exec_pb2_grpc  # noqa: E402

log = logging.getLogger("start_to_ready")

# Connect the moment the server listens: gRPC's default reconnect backoff (1 s, growing) would be measured instead.
FAST_CONNECT = [*CHANNEL_OPTIONS, ("grpc.initial_reconnect_backoff_ms", 10), ("grpc.min_reconnect_backoff_ms", 10),
                ("grpc.max_reconnect_backoff_ms", 50)]
LISTENING = "listening"
PRELOAD = "runtime_preload"
PRELOAD_LINE = re.compile(r"loaded the compiled-code runtime .* in ([\d.]+) s")
PHASES = ("fetch", "load_weights", "profile_memory", "load_compiled", "capture_cudagraphs")


@dataclass
class Run:
    """One fresh exec-server process: seconds since it was started, per phase and step."""

    label: str
    listening_s: float = 0.0  # process start -> the port accepts connections
    preload_s: float = 0.0  # of that, the runtime preload the server logs
    phases: dict[str, float] = field(default_factory=dict)  # LoadModel phase -> seconds (the server's clock)
    steps: dict[str, dict[str, float]] = field(default_factory=dict)  # phase -> step -> seconds
    load_model_s: float = 0.0  # LoadModel sent -> ready (the client's clock)
    ready_s: float = 0.0  # process start -> ready
    evicted_bytes: int = 0
    # Compiled kernels in the caches once the run ended (Triton's cubins, Inductor's C++ libraries): a cold run that
    # adds some built them (or unpacked them from the bundle); a warm run that adds none found them all.
    kernels: dict[str, int] = field(default_factory=dict)


def python_files_dirs() -> list[Path]:
    """Where the exec server's code lives: Python's library and site-packages (torch, triton, transformers and the
    pip-installed CUDA libraries), and this repository."""
    paths = sysconfig.get_paths()
    return sorted({Path(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib")} | {ROOT})


def evict_page_cache(dirs: list[Path]) -> int:
    """Ask the kernel to drop the cached pages of every file under ``dirs`` (not those another process maps);
    returns the bytes of the files asked about. What an unprivileged process can do towards a fresh machine."""
    total = 0
    for directory in dirs:
        for root, _, files in os.walk(directory):
            for name in files:
                path = os.path.join(root, name)
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                except OSError:
                    continue
                try:
                    total += os.fstat(fd).st_size
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                except OSError:
                    pass
                finally:
                    os.close(fd)
    return total


def compile_bundle(store: Path, model: common_pb2.ModelSpec, config: common_pb2.CompileConfig, tmp: Path) -> str:
    """The bundle's key, compiled into ``store`` by a `kiln compile-server` unless it is there already."""
    signing_key = local_keys_dir(store) / PRIVATE_KEY_FILE
    port = free_port()
    env = server_env(tmp / "compile-caches")
    server = ServiceProcess("compile", kiln_command("compile-server", "--host", "127.0.0.1", "--port", str(port),
                                                    "--store", str(store), "--signing-key", str(signing_key)),
                            f"127.0.0.1:{port}", tmp / "compile.log", env)
    server.start()
    try:
        server.wait_healthy(timeout=600)
        started = time.perf_counter()
        with connect(server.address) as channel:
            result = compile_model(compile_pb2_grpc.CompileServiceStub(channel),
                                   compile_pb2.CompileRequest(model=model, config=config))
        how = "in the store already" if result.cache_hit else f"compiled in {time.perf_counter() - started:.1f} s"
        log.info("bundle %s: %s", result.key.digest, how)
        return result.key.digest
    finally:
        server.stop()


def server_env(caches: Path) -> dict:
    """The environment of a server whose Inductor and Triton caches are under ``caches``."""
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return child_environment() | {"TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
                                  "TRITON_CACHE_DIR": str(caches / "triton"), "PYTHONPATH": python_path}


def start_to_ready(label: str, store: Path, trusted: Path, request: exec_pb2.LoadModelRequest, caches: Path,
                   log_path: Path, timeout: float) -> Run:
    """Start an exec server on ``caches``, LoadModel the moment it listens, stop it once the model is ready."""
    run = Run(label)
    port = free_port()
    argv = kiln_command("exec-server", "--host", "127.0.0.1", "--port", str(port), "--store", str(store),
                        "--cache", str(caches / "exec-cache"), "--trusted-keys", str(trusted))
    with open(log_path, "wb") as out:
        started = time.perf_counter()
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=server_env(caches))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=FAST_CONNECT) as channel:
            _wait_listening(channel, process, timeout, log_path)
            run.listening_s = time.perf_counter() - started
            log.info("%s: listening after %.2f s", label, run.listening_s)
            sent = time.perf_counter()

            def phase(p: exec_pb2.StartupPhase) -> None:
                if p.progress and p.step:
                    run.steps.setdefault(p.phase, {})[p.step] = p.seconds
                    log.info("%s:   %-20s %-18s %7.2f s", label, p.phase, p.step, p.seconds)
                elif not p.progress and p.phase != "ready":
                    run.phases[p.phase] = p.seconds
                    log.info("%s: %-20s %7.2f s  %s", label, p.phase, p.seconds, p.detail)

            load(exec_pb2_grpc.ExecServiceStub(channel), request, phase, timeout=timeout)
            now = time.perf_counter()
            run.load_model_s, run.ready_s = now - sent, now - started
            log.info("%s: ready after %.2f s", label, run.ready_s)
    finally:
        _stop(process)
    match = PRELOAD_LINE.search(log_path.read_text(errors="replace"))
    run.preload_s = float(match.group(1)) if match else 0.0
    run.kernels = {"triton": _count(caches / "triton", "*.cubin"), "inductor": _count(caches / "inductor", "*.so")}
    return run


def _count(directory: Path, pattern: str) -> int:
    return sum(1 for _ in directory.rglob(pattern)) if directory.is_dir() else 0


def _wait_listening(channel: grpc.Channel, process: subprocess.Popen, timeout: float, log_path: Path) -> None:
    ready = grpc.channel_ready_future(channel)
    deadline = time.monotonic() + timeout
    while True:
        try:
            ready.result(timeout=0.2)
            return
        except grpc.FutureTimeoutError:
            if process.poll() is not None or time.monotonic() > deadline:
                ready.cancel()
                tail = log_path.read_text(errors="replace")[-3000:]
                sys.exit(f"the exec server did not start listening (exit code {process.poll()}):\n{tail}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def table(runs: list[Run]) -> str:
    """The runs side by side: one row per measure, steps indented under their phase."""
    rows = [("process start -> listening (imports)", [r.listening_s for r in runs]),
            ("  of which the runtime preload", [r.preload_s for r in runs])]
    for phase in PHASES:
        rows.append((f"LoadModel: {phase}", [r.phases.get(phase) for r in runs]))
        steps = dict.fromkeys(s for r in runs for s in r.steps.get(phase, {}))
        rows += [(f"  {step}", [r.steps.get(phase, {}).get(step) for r in runs]) for step in steps]
    rows += [("LoadModel sent -> ready (client)", [r.load_model_s for r in runs]),
             ("**process start -> ready**", [r.ready_s for r in runs])]
    lines = ["| measure | " + " | ".join(f"{r.label} s" for r in runs) + " |", "|---|" + "---:|" * len(runs)]
    for name, values in rows:
        lines.append(f"| {name} | " + " | ".join("–" if v is None else f"{v:.2f}" for v in values) + " |")
    lines.append("| kernels in the caches after the run (Triton cubins / Inductor .so) | "
                 + " | ".join(f"{r.kernels.get('triton', 0)} / {r.kernels.get('inductor', 0)}" for r in runs) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Run]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-compiled-tokens", "--max-num-batched-tokens", dest="max_compiled_tokens", type=int,
                   default=2048, help="the compiled token range, and the step budget")
    p.add_argument("--compile-sizes", default="", help="comma-separated, as the bundle was compiled")
    p.add_argument("--store", type=Path, help="a store directory (default: a temporary one, compiled into first)")
    p.add_argument("--key", default="", help="load this bundle of --store (with --trusted-keys) instead of compiling")
    p.add_argument("--trusted-keys", type=Path, help="default: the key pair kept beside --store")
    p.add_argument("--runs", default="cold,warm", help="comma-separated: cold (fresh caches), warm (the same again)")
    p.add_argument("--no-evict", action="store_true", help="leave the page cache as it is before a cold run")
    p.add_argument("--runtime-mode", default="", help="eager, compiled or cudagraph (default: the device's best)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--quantization", default="", choices=["", "fp8"], help="fp8: the decoder's linears in FP8")
    p.add_argument("--piecewise-capture-sizes", type=lambda t: [int(v) for v in t.split(",") if v.strip()],
                   default=[], help="LoadModel's piecewise_capture_sizes: comma-separated token counts, 0 for no "
                                    "mixed graphs (default: the service's)")
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)

    model = common_pb2.ModelSpec(preset=args.preset, dtype=args.dtype)
    config = compile_config(args.device, [int(s) for s in args.compile_sizes.split(",") if s],
                            args.max_compiled_tokens, quantization=args.quantization)
    with tempfile.TemporaryDirectory(prefix="kiln-start-to-ready-") as name:
        tmp = Path(name)
        store = (args.store or tmp / "store").resolve()
        trusted = args.trusted_keys
        if not args.key:
            generate_key_pair(local_keys_dir(store))
        key = args.key or compile_bundle(store, model, config, tmp)
        trusted = trusted or local_keys_dir(store) / PUBLIC_KEY_FILE
        mode = f"RUNTIME_MODE_{args.runtime_mode.upper()}" if args.runtime_mode else "RUNTIME_MODE_UNSPECIFIED"
        request = exec_pb2.LoadModelRequest(name=args.preset, model=model, config=config,
                                            key=common_pb2.ArtifactKey(digest=key),
                                            runtime_mode=exec_pb2.RuntimeMode.Value(mode),
                                            piecewise_capture_sizes=args.piecewise_capture_sizes)
        runs, caches = [], None
        for n, label in enumerate(args.runs.split(",")):
            if label not in ("cold", "warm"):
                p.error(f"--runs: {label!r} is not cold or warm")
            evicted = 0
            if label == "cold" or caches is None:
                caches = tmp / f"caches-{n}"  # Inductor, Triton and the exec server's bundle cache, all empty
            if label == "cold" and not args.no_evict:
                evicted = evict_page_cache([*python_files_dirs(), store / key])
                log.info("cold: asked the kernel to drop %.2f GB of cached files", evicted / 1e9)
            run = start_to_ready(label, store, trusted, request, caches, tmp / f"exec-{n}-{label}.log",
                                 args.timeout)
            run.evicted_bytes = evicted
            runs.append(run)
    sizes = ",".join(map(str, args.piecewise_capture_sizes)) or "the service's"
    print(f"\n{args.preset} {args.dtype} on {args.device}, dummy weights, bundle {key[:12]} in a filesystem store, "
          f"piecewise_capture_sizes {sizes}, {time.strftime('%Y-%m-%d')}")
    print(table(runs))
    if args.json_out:
        args.json_out.write_text(json.dumps([r.__dict__ for r in runs], indent=1))
    return runs


if __name__ == "__main__":
    main()
