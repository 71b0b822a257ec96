"""``kiln exec-server``, ``kiln load``, ``kiln generate``, ``kiln models``, ``kiln unload`` and ``kiln stats``."""

import argparse
import os
import signal
import sys
import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from google.protobuf import json_format

from exec_service.api.runtime_modes import runtime_mode_to_proto
from kiln.client.channels import connect
from kiln.client.failures import EXEC_SERVICE
from kiln.client.generate import Generation
from kiln.client.load import load, phase_line, ready_line
from kiln.client.requests import model_spec
from kiln.rpc.grpc_server import DEFAULT_MAX_CONNECTION_AGE_S, leave_unfinished_workers, serve_until_signal
from kiln.runtime_mode import RuntimeMode
from kiln_cli import metrics_args, security_args
from kiln_cli.arguments import EXEC_ADDRESS, add_server_address, int_list
from kiln_cli.compile_commands import add_compile_config_args, add_shutdown_grace_arg, compile_config
from kiln_cli.output import Printer, report_rpc_error
from protos import common_pb2, exec_pb2, exec_pb2_grpc

FINISH_REASONS = {exec_pb2.FINISH_REASON_STOP: "stop", exec_pb2.FINISH_REASON_LENGTH: "length"}


def register(subparsers) -> None:
    p = subparsers.add_parser("exec-server", help="run the execute service")
    p.add_argument("--port", type=int, default=50052, help="port to listen on")
    p.add_argument("--compile-server", default="", help="compile service address; bundles are fetched from it")
    p.add_argument("--store", default=None,
                   help="a store shared with the compile services, read first: a directory or redis://HOST:PORT/DB")
    p.add_argument("--cache", default=None, help="downloaded bundles (default: ~/.cache/kiln/exec-cache)")
    p.add_argument("--load", action="append", type=load_request_json, default=[], metavar="JSON",
                   help="a LoadModelRequest as JSON, loaded at start (repeatable): what a replica serves without "
                        "anyone calling LoadModel; its health turns SERVING once it is ready")
    p.add_argument("--trusted-keys", default=os.environ.get("KILN_TRUSTED_KEYS"),
                   help="public keys (a PEM file of one or more, or a directory of *.pub) whose signed bundles "
                        "may be loaded")
    add_shutdown_grace_arg(p)
    p.add_argument("--max-connection-age-s", type=_connection_age, default=DEFAULT_MAX_CONNECTION_AGE_S,
                   help="seconds after which a client is asked to reconnect, so gateways resolving a DNS name find "
                        "replicas added behind it; calls in flight are never cut; 0: never (default: %(default)s)")
    p.add_argument("--openai-port", type=int, default=None,
                   help="also serve the OpenAI-compatible API (kiln api-server's endpoints) on this HTTP port of the "
                        "same host, from this process: no gateway hop; bearer tokens checked as on gRPC (default: off)")
    p.add_argument("--https-cert", default=os.environ.get("KILN_HTTPS_CERT"),
                   help="with --openai-port: serve HTTPS, this certificate (PEM)")
    p.add_argument("--https-key", default=os.environ.get("KILN_HTTPS_KEY"), help="its private key (PEM)")
    security_args.add_http_args(p)
    metrics_args.add_metrics_arg(p)
    security_args.add_server_args(p)
    security_args.add_client_args(p)  # towards the compile service
    p.set_defaults(handler=run_exec_server)

    p = subparsers.add_parser("load", help="load a model on an execute service, printing each startup phase")
    add_server_address(p, EXEC_ADDRESS, "execute service")
    p.add_argument("model", help="a preset name, a local Hugging Face directory or a Hub id (org/name[@revision])")
    p.add_argument("--name", default="", help="name for Generate (default: the preset or directory name)")
    p.add_argument("--weights", default="dummy",
                   help="'dummy', a local HF directory with safetensors, or a Hub id (org/name[@revision])")
    p.add_argument("--weights-seed", type=int, default=0, help="seed of the dummy weights")
    p.add_argument("--key", default="", help="load this bundle instead of compiling from the config")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="longest prompt + output in tokens (default: the model's max_position_embeddings, at most "
                        "4096)")
    p.add_argument("--max-num-seqs", type=int, default=0, help="most sequences in one step (default: 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="the scheduler's step budget, up to --max-compiled-tokens; not a key factor: any budget "
                        "loads the same bundle (default: the compiled range)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.0,
                   help="fraction of device memory Kiln may use on CUDA (default: 0.9)")
    p.add_argument("--kv-cache-bytes", type=int, default=0,
                   help="KV budget on CPU, a cap on CUDA (default: 64 MiB on CPU, no cap on CUDA)")
    p.add_argument("--block-size", type=int, default=0, help="tokens per KV block, a power of two (default: 16)")
    p.add_argument("--capture-sizes", type=int_list, default=[], metavar="N,N,...",
                   help="batch sizes with a CUDA graph (default: 1,2,4 and the multiples of 8 up to max_num_seqs)")
    p.add_argument("--max-num-waiting", type=int, default=0,
                   help="requests that may wait for a slot before Generate answers RESOURCE_EXHAUSTED (default: 256)")
    p.add_argument("--stream-interval", type=int, default=0, metavar="N",
                   help="tokens a stream gathers before it sends them, after its first token at once: fewer messages "
                        "per token under load, tokens in bursts of N (default: 1, every token as it comes)")
    p.add_argument("--kv-cache-dtype", default="", choices=["", "fp8_e4m3", "fp8"],
                   help="fp8_e4m3: keys and values in FP8, twice the blocks (default: the model's dtype)")
    p.add_argument("--kv-cache-scale", type=float, default=0.0,
                   help="the FP8 cache's scale, every layer and head (default: 1.0)")
    p.add_argument("--quantize-head", action="store_true",
                   help="with --quantization fp8: the head (lm_head) in FP8 too (default: the model's dtype)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="compute every prompt token; by default full KV blocks are reused by later prompts with the "
                        "same prefix (docs/prefix-caching.md)")
    p.add_argument("--piecewise-capture-sizes", type=int_list, default=[], metavar="N,N,...",
                   help="token counts with mixed CUDA graphs (whole prefill and mixed steps); 0 turns them off "
                        "(default: 8 ... 512, up to the step token budget)")
    p.add_argument("--runtime-mode", type=RuntimeMode, choices=list(RuntimeMode), default=None,
                   help="how forwards run (default: cudagraph on CUDA, compiled on CPU)")
    p.add_argument("--tensor-parallel-size", type=int, default=0,
                   help="ranks the model is split over, one process each, one GPU each on CUDA (so far: llama, "
                        "qwen2, mistral; docs/tensor-parallel.md; default: 1)")
    add_compile_config_args(p)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    security_args.add_client_args(p)
    p.set_defaults(handler=run_load)

    p = subparsers.add_parser("generate", help="stream tokens for one prompt")
    add_server_address(p, EXEC_ADDRESS, "execute service")
    p.add_argument("--model", required=True, help="a name from kiln load")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text (the model needs a tokenizer)")
    prompt.add_argument("--prompt-ids", type=int_list, metavar="ID,ID,...", help="the prompt as token ids")
    prompt.add_argument("--chat", help="one user message, rendered with the model's chat template")
    prompt.add_argument("--message", action="append", type=_chat_message, metavar="ROLE=CONTENT",
                        help="a chat message (repeat it: --message system='Be brief.' --message user='Hi')")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens to generate at most (default: 16)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature; 0 is greedy (default: 1.0)")
    p.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling: keep the smallest set of tokens with this much probability (default: 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 keeps all (default: 0)")
    p.add_argument("--seed", type=int, default=None, help="seed of this request's sampling (default: none)")
    p.add_argument("--stop-token-ids", type=int_list, default=[], metavar="ID,ID,...",
                   help="token ids that end generation besides the model's end-of-sequence")
    p.add_argument("--stop", action="append", default=[], help="text that ends generation, not returned (repeat it)")
    p.add_argument("--ignore-eos", action="store_true", help="generate past the end-of-sequence token")
    p.add_argument("--min-tokens", type=int, default=0, help="no end-of-sequence or stop before this many tokens")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="in (0, 10]; 1 changes nothing (default: 1)")
    p.add_argument("--logprobs", action="store_true", help="each token's log-probability")
    p.add_argument("--top-logprobs", type=int, default=0, help="with --logprobs: this many alternatives, up to 20")
    p.add_argument("--n", type=int, default=0,
                   help="sequences of the one prompt, each printed whole as it ends (default: 1)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    security_args.add_client_args(p)
    p.set_defaults(handler=run_generate)

    p = subparsers.add_parser("models", help="list the models of an execute service")
    add_server_address(p, EXEC_ADDRESS, "execute service")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    security_args.add_client_args(p)
    p.set_defaults(handler=run_models)

    p = subparsers.add_parser("unload", help="unload a model from an execute service")
    add_server_address(p, EXEC_ADDRESS, "execute service")
    p.add_argument("name", help="the model's name, as kiln models lists it")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    security_args.add_client_args(p)
    p.set_defaults(handler=run_unload)

    p = subparsers.add_parser("stats", help="forward time per batch size, phase and path, and the device's mean wait "
                                            "for the host before those steps (host wait ms)")
    add_server_address(p, EXEC_ADDRESS, "execute service")
    p.add_argument("--model", default="", help="one model's statistics (default: every model's)")
    p.add_argument("--reset", action="store_true", help="clear the statistics after reading them")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    security_args.add_client_args(p)
    p.set_defaults(handler=run_stats)


def load_request_json(text: str) -> exec_pb2.LoadModelRequest:
    """``--load``: a LoadModelRequest in JSON, as grpcurl would send it."""
    try:
        return json_format.Parse(text, exec_pb2.LoadModelRequest())
    except json_format.ParseError as exc:
        raise argparse.ArgumentTypeError(f"not a LoadModelRequest: {exc}") from None


def openai_settings(args, security):
    """--openai-port: the endpoint's ApiServerSettings, on the gRPC server's host, under its shutdown grace and
    request cap; None without it. ValueError for origins the environment gives wrong."""
    from exec_service.openai.server import ApiServerSettings

    if args.openai_port is None:
        return None
    return ApiServerSettings(args.host, args.openai_port, "", https_cert=args.https_cert, https_key=args.https_key,
                             shutdown_grace_s=args.shutdown_grace_s, max_request_bytes=security.max_request_bytes,
                             limits=security_args.http_limits(args), cors_origins=security_args.cors_origins(args))


def run_exec_server(args) -> int:
    from exec_service.server import DEFAULT_CACHE_DIR, ExecServerSettings, start_exec_server
    from exec_service.telemetry.metrics import ExecMetrics
    from kiln.store.signing import TrustedKeys
    from tracing.setup import init_tracing

    if not args.trusted_keys:
        return security_args.refuse_setting(ValueError(
            "the execute service loads only signed bundles: pass --trusted-keys FILE|DIR (or KILN_TRUSTED_KEYS) "
            "with the compile service's public key (`kiln keygen DIR` writes DIR/signing.pub)"))
    if bool(args.https_cert) != bool(args.https_key):
        return security_args.refuse_setting(ValueError("--https-cert and --https-key go together"))
    if args.https_cert and args.openai_port is None:
        return security_args.refuse_setting(ValueError("--https-cert: serves the --openai-port endpoint; name it"))
    if args.cors_origins and args.openai_port is None:
        return security_args.refuse_setting(ValueError("--cors-allow-origin: applies to the --openai-port endpoint; "
                                                       "name it"))
    trusted = TrustedKeys.load(args.trusted_keys)
    security = security_args.server_security(args)
    try:
        openai = openai_settings(args, security)
    except ValueError as exc:
        return security_args.refuse_setting(exc)
    client = security_args.client_security(args)
    telemetry = init_tracing("kiln-exec")  # the resource says which device (kiln.device, kiln.device.name)
    settings = ExecServerSettings(f"{args.host}:{args.port}", trusted, args.compile_server or None, args.store,
                                  args.cache or DEFAULT_CACHE_DIR, security, client, security_args.model_roots(args),
                                  tuple(args.load), hub=security_args.hub_cache(args),
                                  max_connection_age_s=args.max_connection_age_s or None,
                                  openai=openai)
    metrics = metrics_args.start_metrics(args, ExecMetrics)
    try:
        serve_until_signal(lambda: start_exec_server(settings, metrics=metrics.collector if metrics else None),
                           args.shutdown_grace_s)
    finally:
        if metrics:
            metrics.close()
        telemetry.shutdown()
    leave_unfinished_workers()
    return 0



def _connection_age(text: str) -> float:
    value = float(text)
    if not (value == 0 or 1 <= value <= 86400):
        raise argparse.ArgumentTypeError(f"must be 0 (never) or in [1, 86400] seconds, got {text}")
    return value

def load_request(args) -> exec_pb2.LoadModelRequest:
    request = exec_pb2.LoadModelRequest(
        name=args.name, model=model_spec(args.model, args.dtype), config=compile_config(args),
        weights=local_weights(args.weights), weights_seed=args.weights_seed, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_bytes=args.kv_cache_bytes,
        block_size=args.block_size, capture_sizes=args.capture_sizes, max_num_waiting=args.max_num_waiting,
        stream_interval=args.stream_interval,
        runtime_mode=runtime_mode_to_proto(args.runtime_mode), piecewise_capture_sizes=args.piecewise_capture_sizes,
        kv_cache_dtype=args.kv_cache_dtype, kv_cache_scale=args.kv_cache_scale,
        tensor_parallel_size=args.tensor_parallel_size, quantize_head=args.quantize_head)
    if args.no_prefix_caching:
        request.enable_prefix_caching = False
    if args.key:
        request.key.CopyFrom(common_pb2.ArtifactKey(digest=args.key))
    return request


def local_weights(weights: str) -> str:
    """A local directory travels as its absolute path (the server's working directory is not the client's)."""
    return str(Path(weights).resolve()) if weights != "dummy" and Path(weights).exists() else weights


def _call(args, method: str, work) -> int:
    """Run ``work(stub, printer)`` against the execute service at ``args.server``; a failed call exits 1, saying
    what answered there when it is not an execute service."""
    out = Printer(args.json)
    security = security_args.client_security(args)
    with connect(args.server, security) as channel:
        try:
            work(exec_pb2_grpc.ExecServiceStub(channel), out)
        except grpc.RpcError as exc:
            return report_rpc_error(exc, args.server, security, EXEC_SERVICE, method)
        except KeyboardInterrupt:  # closing the channel cancels the call: the server frees what it held
            print("\ninterrupted", file=sys.stderr)
            return 130
    return 0


def run_load(args) -> int:
    def work(stub, out: Printer):
        def phase(p: exec_pb2.StartupPhase) -> None:
            out.message(exec_pb2.LoadModelEvent(phase=p), phase_line(p))

        sizing = load(stub, load_request(args), phase)
        out.message(exec_pb2.LoadModelEvent(ready=sizing), ready_line(sizing))

    return _call(args, "LoadModel", work)


def generate_request(args) -> exec_pb2.GenerateRequest:
    request = exec_pb2.GenerateRequest(
        model=args.model, top_k=args.top_k, stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos,
        stop=args.stop, min_tokens=args.min_tokens, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, logprobs=args.logprobs, top_logprobs=args.top_logprobs, n=args.n)
    if args.prompt is not None:
        request.prompt = args.prompt
    elif args.chat is not None:
        request.messages.add(role="user", content=args.chat)
    elif args.message:
        request.messages.extend(args.message)
    else:
        request.prompt_ids.extend(args.prompt_ids)
    for field in ("max_tokens", "temperature", "top_p", "seed", "repetition_penalty"):
        if getattr(args, field) is not None:
            setattr(request, field, getattr(args, field))
    return request


def _chat_message(text: str) -> exec_pb2.ChatMessage:
    role, equals, content = text.partition("=")
    if not equals:
        raise argparse.ArgumentTypeError(f"{text!r}: write it as ROLE=CONTENT, e.g. user='Hello'")
    return exec_pb2.ChatMessage(role=role, content=content)


@contextmanager
def cancel_on_interrupt(generation: Generation) -> Iterator[threading.Event]:
    """Ctrl-C cancels the call, whose stream then ends with CANCELLED, rather than raising KeyboardInterrupt inside
    gRPC's own locks (which printed their traceback). The event says whether it was pressed."""
    interrupted = threading.Event()

    def cancel(signum, frame) -> None:
        interrupted.set()
        generation.cancel()

    previous = signal.signal(signal.SIGINT, cancel)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def run_generate(args) -> int:
    def work(stub, out: Printer):
        generation = Generation(stub, generate_request(args))
        with cancel_on_interrupt(generation) as interrupted:
            try:
                print_responses(generation, out, several=args.n > 1)
            except grpc.RpcError:
                if interrupted.is_set():
                    raise KeyboardInterrupt from None
                raise

    return _call(args, "Generate", work)


def print_responses(responses, out: Printer, several: bool = False) -> None:
    """Tokens as they stream (text where the model has a tokenizer), then one line of usage. ``several`` sequences
    (n > 1) are printed each whole as it ends, under its index. With logprobs, a line per token before the usage."""
    texts: dict[int, str] = defaultdict(str)
    logprobs: dict[int, list] = defaultdict(list)
    for response in responses:
        if out.as_json:
            out.message(response, "")
            continue
        piece = response.text or "".join(f" {t}" for t in response.token_ids)
        logprobs[response.index] += response.logprobs
        if several:
            texts[response.index] += piece
        elif piece:
            sys.stdout.write(piece)
            sys.stdout.flush()
        if not response.finish_reason:
            continue
        out.line(f"[{response.index}] {texts.pop(response.index)}" if several else "")  # ends the streamed line
        for logprob in logprobs.pop(response.index):
            top = ", ".join(f"{t.token or t.token_id!r} {t.logprob:.3f}" for t in logprob.top)
            out.line(f"  {logprob.token or logprob.token_id!r} {logprob.logprob:.3f}" + (f"  ({top})" if top else ""))
        u = response.usage
        cached = f" ({u.cached_tokens} cached)" if u.cached_tokens else ""
        out.line(f"[{FINISH_REASONS.get(response.finish_reason, '?')}] {u.prompt_tokens} prompt{cached} + "
                 f"{u.output_tokens} output tokens, first token {u.time_to_first_token_s * 1000:.1f} ms, "
                 f"total {u.total_s:.3f} s")


def run_models(args) -> int:
    def work(stub, out: Printer):
        models = stub.ListModels(exec_pb2.ListModelsRequest()).models
        if not models:
            out.line(f"no models loaded on {args.server} (kiln load puts one there)")
        for m in models:
            state = exec_pb2.ModelState.Name(m.state).removeprefix("MODEL_STATE_").lower()
            window = f", KV window {m.sizing.kv_window}" if m.sizing.kv_window else ""
            detail = (f"{m.sizing.runtime_mode} on {m.sizing.device}, {m.num_free_blocks}/{m.sizing.num_kv_blocks} "
                      f"blocks free (peak {m.peak_used_blocks} held{window}), {m.num_running} running, "
                      f"{m.num_waiting} waiting, {prefix_cache(m)}") if m.HasField("sizing") else m.error
            out.message(m, f"{m.name:<20} {state:<8} {detail}")

    return _call(args, "ListModels", work)


def prefix_cache(m: exec_pb2.ModelInfo) -> str:
    """The prefix cache of a ready model in a few words: its hit rate and the blocks it knows by content."""
    if not m.sizing.prefix_caching:
        return "prefix caching off"
    queried, hit = m.prefix_cache_queried_tokens, m.prefix_cache_hit_tokens
    rate = f"{100 * hit / queried:.1f}% of {queried} prompt tokens" if queried else "no prompts yet"
    return f"prefix cache hits {rate}, {m.prefix_cache_blocks} blocks cached"


def run_unload(args) -> int:
    def work(stub, out: Printer):
        out.message(stub.UnloadModel(exec_pb2.UnloadModelRequest(name=args.name)), f"unloaded {args.name}")

    return _call(args, "UnloadModel", work)


def run_stats(args) -> int:
    def work(stub, out: Printer):
        stats = stub.GetForwardStats(exec_pb2.GetForwardStatsRequest(model=args.model, reset=args.reset)).stats
        if not stats:
            out.line("no forward statistics yet: no step has run" + (f" for {args.model}" if args.model else ""))
            return
        out.line(f"{'model':<20} {'batch':>5} {'phase':<7} {'path':<15} {'count':>8} {'median ms':>10} "
                 f"{'p90 ms':>8} {'p99 ms':>8} {'host wait ms':>12}  mode")
        for s in stats:
            out.message(s, f"{s.model:<20} {s.batch_size:>5} {s.phase:<7} {s.path:<15} {s.count:>8} "
                           f"{s.median_ms:>10.3f} {s.p90_ms:>8.3f} {s.p99_ms:>8.3f} "
                           f"{s.host_wait_ms / s.count:>12.3f}  {s.runtime_mode}")

    return _call(args, "GetForwardStats", work)
