"""What forward spans add to an engine step's host time, without a GPU.

A loop stands in for the engine thread: each step waits --device-ms with the GIL released (as the host does while
the device runs the forward), then runs --host-us of Python (the step's own host work), then calls the real
ForwardSpans observer with a StepRecord serving --batch-size requests (one link each). Spans go through the real
writer process, SDK batch processor and OTLP exporter to a real receiver (tracing/otlp_receiver.py) on loopback.

usage: python bench/forward_span_cost.py [--batch-size 32] [--steps 400]
"""

import argparse
import os
import time

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

from kiln.step_record import StepRecord
from tracing.forward_spans import ForwardSpans
from tracing.otlp_receiver import OtlpReceiver


def host_work(iterations: int) -> int:
    total = 0
    for i in range(iterations):
        total += i * i
    return total


def per_step_us(observer, steps: int, device_s: float, work: int, request_ids: tuple[str, ...]) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        time.sleep(device_s)
        host_work(work)
        if observer is not None:
            now = time.time_ns()
            observer(StepRecord(model="bench", batch_size=len(request_ids), num_tokens=len(request_ids),
                                padded_size=len(request_ids), runtime_mode="cudagraph", path="full_graph",
                                phase="decode",
                                start_ns=now - int(device_s * 1e9), end_ns=now, request_ids=request_ids))
    return (time.perf_counter() - started) / steps * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--device-ms", type=float, default=5.0)
    p.add_argument("--host-work", type=int, default=3000, help="loop iterations of Python per step (~0.3 ms)")
    args = p.parse_args()
    receiver = OtlpReceiver()
    receiver.start()
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint  # read by the writer process
    tracer = TracerProvider().get_tracer("bench")
    requests = {f"r{i}": tracer.start_span(f"request {i}").get_span_context() for i in range(args.batch_size)}
    observer = ForwardSpans(Resource({"service.name": "kiln-bench"}), ratio=1.0)
    for request_id, context in requests.items():
        observer.request_started(request_id, context)
    ids = tuple(requests)
    off = per_step_us(None, args.steps, args.device_ms / 1e3, args.host_work, ids)
    on = per_step_us(observer, args.steps, args.device_ms / 1e3, args.host_work, ids)
    observer.close()
    receiver.stop()
    received = sum(s.name == "forward" for s in receiver.spans())
    print(f"\n{args.steps} steps, {args.device_ms} ms device wait, batch {args.batch_size} "
          f"({time.strftime('%Y-%m-%d')})")
    print("| forward spans | µs per step | added µs | added % |")
    print("|---|---|---|---|")
    print(f"| off | {off:.0f} | - | - |")
    print(f"| on, ratio 1.0 | {on:.0f} | {on - off:.0f} | {(on - off) / off * 100:.1f}% |")
    print(f"\nforward spans received: {received} of {args.steps}")


if __name__ == "__main__":
    main()
