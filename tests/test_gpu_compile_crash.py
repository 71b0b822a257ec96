"""The compile service's SIGSEGV (issue 23): many cold CUDA compiles in a row through a `kiln compile-server` started
by kiln_cli.service_process (the benches' and `kiln demo`'s path), with tracing off and on, and a SIGTERM at the
end. Every Compile must end with a result, the process must still run after each and exit 0 on SIGTERM, and its
log must hold no fatal error (faulthandler would have written the stack of every thread there, and a failure
prints the log's end). Each mode runs with Inductor's compile workers as configured (a sidecar process pool,
started from the compile's worker thread) and with them off (TORCHINDUCTOR_COMPILE_THREADS=1), so that a crash in
one and not the other says where to look.

    KILN_CRASH_COMPILES=N  cold compiles per run (default 4)
    KILN_CRASH_PRESET=P    compile preset P (e.g. llama-3-8b, where the crash was seen) with a new
                           max_compiled_tokens each time, instead of a small Llama with a new MLP width
"""

import json
import os

import grpc
import pytest
import torch

from kiln.rpc.grpc_server import CHANNEL_OPTIONS
from kiln.store.signing import PRIVATE_KEY_FILE, generate_key_pair
from kiln_cli.service_process import ServiceProcess, child_environment, free_port, kiln_command
from protos import common_pb2, compile_pb2, compile_pb2_grpc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPILES = int(os.environ.get("KILN_CRASH_COMPILES", "4"))
PRESET = os.environ.get("KILN_CRASH_PRESET", "")
FATAL = ("Fatal Python error", "Segmentation fault", "core dumped", "Aborted")


def compile_request(i: int) -> compile_pb2.CompileRequest:
    """A request with a new key each time: a small Llama whose MLP width differs by ``i`` (new kernels, so every
    compile is cold in Inductor and Triton), or PRESET with a new compiled token range."""
    if PRESET:
        return compile_pb2.CompileRequest(
            model=common_pb2.ModelSpec(preset=PRESET, dtype="bfloat16"),
            config=common_pb2.CompileConfig(device="cuda", max_compiled_tokens=512 + 128 * i))
    config = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512 + 64 * i, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 1024}
    return compile_pb2.CompileRequest(
        model=common_pb2.ModelSpec(config_json=json.dumps(config), dtype="bfloat16"),
        config=common_pb2.CompileConfig(device="cuda", compile_sizes=[1, 8], max_compiled_tokens=256))


@pytest.mark.parametrize("workers", ["pool", "none"])
@pytest.mark.parametrize("tracing", ["off", "on"])
def test_cold_compiles_in_a_loop_never_crash_the_compile_service(tmp_path, tracing, workers):
    from tracing.otlp_receiver import OtlpReceiver

    generate_key_pair(tmp_path / "keys")
    receiver = OtlpReceiver().start() if tracing == "on" else None
    env = child_environment() | {
        "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    if workers == "none":
        env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    if receiver is not None:
        env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    port = free_port()
    service = ServiceProcess("compile", kiln_command(
        "compile-server", "--host", "127.0.0.1", "--port", str(port), "--store", str(tmp_path / "store"),
        "--signing-key", str(tmp_path / "keys" / PRIVATE_KEY_FILE)), f"127.0.0.1:{port}", tmp_path / "compile.log",
        env)
    service.start()
    outcomes = []
    try:
        service.wait_healthy(timeout=300)
        with grpc.insecure_channel(service.address, options=CHANNEL_OPTIONS) as channel:
            stub = compile_pb2_grpc.CompileServiceStub(channel)
            for i in range(COMPILES):
                try:
                    events = list(stub.Compile(compile_request(i), timeout=600))
                    outcomes.append("compiled" if not events[-1].result.cache_hit else "hit")
                except grpc.RpcError as exc:
                    outcomes.append(f"{exc.code().name}: {exc.details()}")
                assert service.process.poll() is None, (
                    f"compile {i} (tracing {tracing}, workers {workers}): the service exited with "
                    f"{service.process.returncode}; outcomes {outcomes}\n{service.log_tail(200)}")
        assert outcomes == ["compiled"] * COMPILES, f"{outcomes}\n{service.log_tail(200)}"
        assert service.stop(timeout=120) == 0
    finally:
        service.kill()
        if receiver is not None:
            receiver.stop()
    log = service.log_path.read_text(errors="replace")
    assert not [line for line in log.splitlines() if any(word in line for word in FATAL)], service.log_tail(200)
