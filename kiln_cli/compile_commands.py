"""``kiln compile-server``, ``kiln compile`` and ``kiln artifacts list|rm``."""

import argparse
import os
from pathlib import Path

import grpc

from kiln.client.channels import connect
from kiln.client.compile import compile_model
from kiln.client.failures import COMPILE_SERVICE
from kiln.client.requests import compile_config as build_compile_config
from kiln.client.requests import model_spec
from kiln.rpc.grpc_server import DEFAULT_SHUTDOWN_GRACE_S, leave_unfinished_workers, serve_until_signal
from kiln_cli import metrics_args, security_args
from kiln_cli.arguments import COMPILE_ADDRESS, add_server_address, int_list, json_object, name_list
from kiln_cli.output import Printer, report_rpc_error
from protos import common_pb2, compile_pb2, compile_pb2_grpc

DEFAULT_STORE = os.environ.get("KILN_STORE", str(Path.home() / ".cache" / "kiln" / "store"))


def register(subparsers) -> None:
    p = subparsers.add_parser("compile-server", help="run the compile service")
    p.add_argument("--port", type=int, default=50051, help="port to listen on")
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
    metrics_args.add_metrics_arg(p)
    security_args.add_server_args(p)
    p.set_defaults(handler=run_compile_server)

    p = subparsers.add_parser("compile", help="compile a model on a compile service")
    p.add_argument("model", help="a preset name, a local Hugging Face directory or a Hub id (org/name[@revision])")
    add_server_address(p, COMPILE_ADDRESS, "compile service", positional=False)
    add_compile_config_args(p)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    security_args.add_client_args(p)
    p.set_defaults(handler=run_compile)

    p = subparsers.add_parser("artifacts", help="list or remove stored bundles")
    p.add_argument("action", choices=["list", "rm"])
    p.add_argument("keys", nargs="*", help="keys to remove (rm)")
    add_server_address(p, COMPILE_ADDRESS, "compile service", positional=False)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
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
    p.add_argument("--compile-sizes", type=int_list, default=[], metavar="N,N,...",
                   help="token counts compiled for a static shape besides the symbolic one")
    p.add_argument("--max-compiled-tokens", type=int, default=0,
                   help="upper end of the compiled token range, a cache-key factor (default: 512)")
    p.add_argument("--splitting-ops", type=name_list, default=None, metavar="OP,OP,...",
                   help="ops to split the graph at ('' for one full graph; default: Kiln's attention)")
    p.add_argument("--inductor-config", type=json_object, default="", metavar="JSON",
                   help="Inductor config patches as a JSON object, e.g. '{\"max_autotune\": false}'")
    p.add_argument("--quantization", default="", choices=["", "fp8"],
                   help="fp8: the decoder's linears in FP8, quantized at load (docs/fp8.md; default: none)")


def compile_config(args) -> common_pb2.CompileConfig:
    """The CompileConfig the compile flags of ``kiln compile`` and ``kiln load`` describe."""
    return build_compile_config(args.device, args.compile_sizes, args.max_compiled_tokens, args.splitting_ops,
                                args.inductor_config, args.quantization)


def run_compile_server(args) -> int:
    from compile_service.metrics import CompileMetrics
    from compile_service.server import DEFAULT_CACHE_DIR, CompileServerSettings, start_compile_server
    from kiln.store.signing import Signer, TrustedKeys
    from tracing.setup import init_tracing

    if not args.signing_key:
        return security_args.refuse_setting(ValueError(
            "the compile service signs every bundle: pass --signing-key FILE (or KILN_SIGNING_KEY); "
            "`kiln keygen DIR` writes a key pair"))
    settings = CompileServerSettings(
        f"{args.host}:{args.port}", args.store, Signer.load(args.signing_key),
        TrustedKeys.load(args.trusted_keys) if args.trusted_keys else None, security_args.server_security(args),
        tuple(security_args.model_roots(args)), args.cache or DEFAULT_CACHE_DIR, args.lease_s,
        security_args.hub_cache(args))
    telemetry = init_tracing("kiln-compile")
    metrics = metrics_args.start_metrics(args, CompileMetrics)
    try:
        serve_until_signal(lambda: start_compile_server(settings, metrics.collector if metrics else None),
                           args.shutdown_grace_s)
    finally:
        if metrics:
            metrics.close()
        telemetry.shutdown()
    leave_unfinished_workers()
    return 0


def print_compile_progress(p: compile_pb2.CompileProgress, out: Printer) -> None:
    """A bar for Inductor's pieces on a terminal, a line for every other phase."""
    if p.phase == "inductor" and not out.as_json:
        out.progress(p.piece, p.num_pieces, f"inductor piece {p.piece}/{p.num_pieces} size {p.size}")
    else:
        out.message(p, f"{p.elapsed_s:7.2f}s  {p.phase}")


def run_compile(args) -> int:
    out = Printer(args.json)
    request = compile_pb2.CompileRequest(model=model_spec(args.model, args.dtype), config=compile_config(args))
    security = security_args.client_security(args)
    with connect(args.server, security) as channel:
        try:
            r = compile_model(compile_pb2_grpc.CompileServiceStub(channel), request,
                              lambda p: print_compile_progress(p, out))
        except grpc.RpcError as exc:
            return report_rpc_error(exc, args.server, security, COMPILE_SERVICE, "Compile")
    timings = ", ".join(f"{t.phase} {t.seconds:.2f}s" for t in r.timings)
    out.message(r, f"key {r.key.digest}\n{'cache hit' if r.cache_hit else 'compiled'}: {r.num_pieces} pieces, "
                   f"{r.bundle_bytes / 1e6:.2f} MB, {r.total_s:.2f}s ({timings})")
    return 0


def run_artifacts(args) -> int:
    out = Printer(args.json)
    security = security_args.client_security(args)
    with connect(args.server, security) as channel:
        stub = compile_pb2_grpc.CompileServiceStub(channel)
        method = "ListArtifacts" if args.action == "list" else "DeleteArtifact"
        try:
            if args.action == "list":
                artifacts = stub.ListArtifacts(compile_pb2.ListArtifactsRequest()).artifacts
                if not artifacts:
                    out.line(f"no artifacts in the store of {args.server} (kiln compile puts one there)")
                for a in artifacts:
                    out.message(a, f"{a.key.digest[:16]}  {a.model:<16} {a.size_bytes / 1e6:8.2f} MB  "
                                   f"{a.num_pieces:3d} pieces  {a.config_summary}")
            else:
                for key in args.keys:
                    r = stub.DeleteArtifact(compile_pb2.DeleteArtifactRequest(key=common_pb2.ArtifactKey(digest=key)))
                    out.message(r, f"removed {key} ({r.freed_bytes / 1e6:.2f} MB)")
        except grpc.RpcError as exc:
            return report_rpc_error(exc, args.server, security, COMPILE_SERVICE, method)
    return 0
