"""``kiln compile-server``, ``kiln compile`` and ``kiln artifacts list|rm``."""

import argparse
import os
from pathlib import Path

import grpc

from kiln.rpc.grpc_server import CHANNEL_OPTIONS, DEFAULT_SHUTDOWN_GRACE_S, leave_unfinished_workers, serve_until_signal
from kiln_cli import security_args
from kiln_cli.output import Printer, report_rpc_error
from protos import common_pb2, compile_pb2, compile_pb2_grpc

DEFAULT_STORE = os.environ.get("KILN_STORE", str(Path.home() / ".cache" / "kiln" / "store"))


def register(subparsers) -> None:
    p = subparsers.add_parser("compile-server", help="run the compile service")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--store", default=DEFAULT_STORE,
                   help="artifact store: a directory or redis://HOST:PORT/DB, rediss://... (default: %(default)s)")
    p.add_argument("--cache", default=None,
                   help="local copies of a Redis store's bundles (default: ~/.cache/kiln/compile-cache)")
    p.add_argument("--lease-s", type=float, default=None,
                   help="Redis store: seconds a compile's lease outlives a dead holder (default: 30)")
    p.add_argument("--signing-key", default=os.environ.get("KILN_SIGNING_KEY"),
                   help="Ed25519 private key every bundle is signed with (kiln keygen DIR writes one)")
    p.add_argument("--trusted-keys", default=os.environ.get("KILN_TRUSTED_KEYS"),
                   help="public keys (file or directory of *.pub) whose bundles in the store still count as hits: "
                        "keys rotated out")
    add_shutdown_grace_arg(p)
    security_args.add_server_args(p)
    p.set_defaults(handler=run_compile_server)

    p = subparsers.add_parser("compile", help="compile a model on a compile service")
    p.add_argument("model", help="a preset name or a local Hugging Face directory")
    p.add_argument("--server", default="localhost:50051")
    add_compile_config_args(p)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    security_args.add_client_args(p)
    p.set_defaults(handler=run_compile)

    p = subparsers.add_parser("artifacts", help="list or remove stored bundles")
    p.add_argument("action", choices=["list", "rm"])
    p.add_argument("keys", nargs="*", help="keys to remove (rm)")
    p.add_argument("--server", default="localhost:50051")
    p.add_argument("--json", action="store_true")
    security_args.add_client_args(p)
    p.set_defaults(handler=run_artifacts)


def add_shutdown_grace_arg(p) -> None:
    p.add_argument("--shutdown-grace-s", type=_grace, default=DEFAULT_SHUTDOWN_GRACE_S,
                   help="on SIGTERM or Ctrl-C, seconds calls in flight may take to finish (default: %(default)s)")


def _grace(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be in [0, 3600] seconds, got {text}")
    return value


def add_compile_config_args(p) -> None:
    p.add_argument("--dtype", default="", help="float32, bfloat16 or float16 (default: by device)")
    p.add_argument("--device", default="", help="cpu or cuda (default: cuda when the server has one)")
    p.add_argument("--compile-sizes", default="", help="comma-separated token counts compiled statically")
    p.add_argument("--max-num-batched-tokens", type=int, default=0)
    p.add_argument("--splitting-ops", default=None,
                   help="comma-separated ops to split at ('' for one full graph; default: Kiln's attention)")
    p.add_argument("--inductor-config", default="", help="Inductor config patches as a JSON object")
    p.add_argument("--quantization", default="", choices=["", "fp8"],
                   help="fp8: the decoder's linears in FP8, quantized at load (docs/fp8.md; default: none)")


def model_spec(model: str, dtype: str) -> common_pb2.ModelSpec:
    """Something that looks like a path is an HF directory; anything else is a preset name."""
    if Path(model).exists() or "/" in model:
        return common_pb2.ModelSpec(hf_dir=str(Path(model).resolve()), dtype=dtype)
    return common_pb2.ModelSpec(preset=model, dtype=dtype)


def compile_config(args) -> common_pb2.CompileConfig:
    config = common_pb2.CompileConfig(
        compile_sizes=[int(s) for s in args.compile_sizes.split(",") if s.strip()],
        max_num_batched_tokens=args.max_num_batched_tokens,
        inductor_config_patches_json=args.inductor_config, device=args.device, quantization=args.quantization)
    if args.splitting_ops is not None:
        config.splitting_ops.ops.extend(op for op in args.splitting_ops.split(",") if op)
        config.splitting_ops.SetInParent()
    return config


def run_compile_server(args) -> int:
    from compile_service.server import DEFAULT_CACHE_DIR, start_compile_server
    from kiln.store.signing import Signer, TrustedKeys
    from tracing.grpc_instrumentation import server_interceptors
    from tracing.setup import init_tracing

    if not args.signing_key:
        return security_args.refuse_setting(ValueError(
            "the compile service signs every bundle: pass --signing-key FILE (or KILN_SIGNING_KEY); "
            "`kiln keygen DIR` writes a key pair"))
    signer = Signer.load(args.signing_key)
    trusted = TrustedKeys.load(args.trusted_keys) if args.trusted_keys else None
    security = security_args.server_security(args)
    telemetry = init_tracing("kiln-compile")

    try:
        serve_until_signal(lambda: start_compile_server(
            args.store, f"{args.host}:{args.port}", server_interceptors(), signer=signer, trusted=trusted,
            security=security, model_roots=security_args.model_roots(args), cache_dir=args.cache or DEFAULT_CACHE_DIR,
            lease_s=args.lease_s), args.shutdown_grace_s)
    finally:
        telemetry.shutdown()
    leave_unfinished_workers()
    return 0


def print_compile_events(events, out: Printer) -> compile_pb2.CompileResult:
    """Stream Compile events to the terminal; returns the result."""
    for event in events:
        if event.HasField("progress"):
            p = event.progress
            if p.phase == "inductor" and not out.as_json:
                out.progress(p.piece, p.num_pieces, f"inductor piece {p.piece}/{p.num_pieces} size {p.size}")
            else:
                out.message(p, f"{p.elapsed_s:7.2f}s  {p.phase}")
        else:
            r = event.result
            timings = ", ".join(f"{t.phase} {t.seconds:.2f}s" for t in r.timings)
            out.message(r, f"key {r.key.digest}\n{'cache hit' if r.cache_hit else 'compiled'}: {r.num_pieces} pieces, "
                           f"{r.bundle_bytes / 1e6:.2f} MB, {r.total_s:.2f}s ({timings})")
            return r
    raise RuntimeError("Compile stream ended without a result")


def client_channel(args, address: str) -> grpc.Channel:
    """A channel to ``address`` with the command's TLS settings and KILN_AUTH_TOKEN."""
    return security_args.client_security(args).channel(address, CHANNEL_OPTIONS)


def run_compile(args) -> int:
    out = Printer(args.json)
    request = compile_pb2.CompileRequest(model=model_spec(args.model, args.dtype), config=compile_config(args))
    with client_channel(args, args.server) as channel:
        try:
            print_compile_events(compile_pb2_grpc.CompileServiceStub(channel).Compile(request), out)
        except grpc.RpcError as exc:
            return report_rpc_error(exc)
    return 0


def run_artifacts(args) -> int:
    out = Printer(args.json)
    with client_channel(args, args.server) as channel:
        stub = compile_pb2_grpc.CompileServiceStub(channel)
        try:
            if args.action == "list":
                for a in stub.ListArtifacts(compile_pb2.ListArtifactsRequest()).artifacts:
                    out.message(a, f"{a.key.digest[:16]}  {a.model:<16} {a.size_bytes / 1e6:8.2f} MB  "
                                   f"{a.num_pieces:3d} pieces  {a.config_summary}")
            else:
                for key in args.keys:
                    r = stub.DeleteArtifact(compile_pb2.DeleteArtifactRequest(key=common_pb2.ArtifactKey(digest=key)))
                    out.message(r, f"removed {key} ({r.freed_bytes / 1e6:.2f} MB)")
        except grpc.RpcError as exc:
            return report_rpc_error(exc)
    return 0
