"""What ``kiln:inter_token_latency_seconds`` costs: on the engine thread, per token, what Sequence.append_token takes
and the part of it that records the token's time (one list append; the clock is read once per step, in
Scheduler.postprocess); on the event loop, per gap, what ExecMetrics.request_ended takes to observe a request's gaps
when it ends. CPU only, no server: ``python bench/itl_overhead.py [--tokens N] [--repeat R]``."""

import argparse
import timeit

from prometheus_client import CollectorRegistry

from exec_service.engine.sequence import SamplingParams, Sequence
from exec_service.telemetry.metrics import ExecMetrics


def fresh(tokens: int) -> Sequence:
    return Sequence("r", [1, 2, 3], SamplingParams(max_tokens=tokens + 1, ignore_eos=True), tokens + 10)


def best_ns(statement, setup, number: int, repeat: int) -> float:
    return min(timeit.repeat(statement, setup, number=1, repeat=repeat)) / number * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=100_000, help="tokens of one sequence per measurement")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    n = args.tokens
    state = {}

    def setup():
        state["seq"] = fresh(n)

    def append_tokens():
        seq = state["seq"]
        for _ in range(n):
            seq.append_token(5, 1.0)

    def append_times():
        times = state["seq"].token_times_s
        for _ in range(n):
            times.append(1.0)

    def empty_loop():
        for _ in range(n):
            pass

    loop = best_ns(empty_loop, setup, n, args.repeat)
    print(f"append_token, per token:            {best_ns(append_tokens, setup, n, args.repeat) - loop:7.0f} ns")
    print(f"  of which the token's time (append): {best_ns(append_times, setup, n, args.repeat) - loop:7.0f} ns")

    metrics = ExecMetrics(CollectorRegistry())
    ended = {}
    for length in (1, 1000):
        ended[length] = fresh(length)
        for i in range(length):
            ended[length].append_token(5, i * 0.001)
    took = {length: best_ns(lambda s=seq: metrics.request_ended("m", s, "ok"), lambda: None, 1, args.repeat)
            for length, seq in ended.items()}
    print(f"request_ended, per gap (event loop): {(took[1000] - took[1]) / 999:7.0f} ns "
          f"(a 1000-token request: {took[1000] / 1e3:.0f} us, a 1-token one {took[1] / 1e3:.1f} us)")


if __name__ == "__main__":
    main()
