"""What a cache-hit LoadModel pays before anything is fetched: the ``bundle_key`` step of a fresh execute service.

Starts the compile and execute services locally (``kiln demo``'s LocalServices) on one store, RUNS times: the first
run compiles, each later one is a fresh pair of processes whose LoadModel (by spec, so the execute service computes
the key) finds the bundle. Prints every run's fetch steps and load_compiled steps, so where the per-process costs
land (the key's factors, torch's CPU vector-ISA probe, the loader) can be read off.

usage: python bench/bundle_key.py [--runs 3] [--preset tiny-llama] [--device cpu]
"""

import argparse
import tempfile
from pathlib import Path

from kiln.client.channels import connect
from kiln.client.load import load
from kiln.client.requests import compile_config, model_spec
from kiln_cli.service_process import LocalServices
from protos import exec_pb2, exec_pb2_grpc


def step_seconds(address: str, request: exec_pb2.LoadModelRequest) -> dict[str, float]:
    """One LoadModel; the seconds of each step inside its phases."""
    seconds: dict[str, float] = {}

    def step(phase: exec_pb2.StartupPhase) -> None:
        if phase.progress and phase.step:
            seconds[phase.step] = phase.seconds

    with connect(address) as channel:
        load(exec_pb2_grpc.ExecServiceStub(channel), request, step)
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--preset", default="tiny-llama")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kiln-bundle-key-"))
    request = exec_pb2.LoadModelRequest(name="bench", model=model_spec(args.preset),
                                        config=compile_config(args.device))
    print("| run | " + " | ".join(STEPS) + " |\n|---|" + "---|" * len(STEPS))
    for run in range(args.runs):
        workdir = tmp / f"run-{run}"
        workdir.mkdir()
        services = LocalServices(workdir, tmp / "store")
        try:
            services.start(600)
            seconds = step_seconds(services.exec.address, request)
            services.stop()
        finally:
            services.cleanup()
        label = "cold (compiles)" if run == 0 else f"{run}: fresh processes, store hit"
        print(f"| {label} | " + " | ".join(f"{seconds.get(s, 0):.2f}" for s in STEPS) + " |", flush=True)


STEPS = ("bundle_key", "verify", "check_factors", "unpickle", "warm_up", "warm_up_attention")

if __name__ == "__main__":
    main()
