"""Counters that prove what a process compiled: Dynamo frames and Inductor compiles, read from torch itself."""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch._dynamo.utils import counters


@dataclass(frozen=True)
class CompileCounts:
    dynamo_graphs: int  # graphs Dynamo captured, by frame conversion or aot_compile
    inductor_compiles: int  # graphs handed to AOTAutograd + Inductor (standalone_compile included)

    def __sub__(self, other: "CompileCounts") -> "CompileCounts":
        return CompileCounts(self.dynamo_graphs - other.dynamo_graphs, self.inductor_compiles - other.inductor_compiles)


def compile_counts() -> CompileCounts:
    return CompileCounts(
        dynamo_graphs=counters["stats"]["unique_graphs"],
        inductor_compiles=counters["aot_autograd"]["total"],
    )


class CompiledSomething(RuntimeError):
    """Raised when a region that must not compile did."""


@contextmanager
def expect_no_compile(what: str) -> Iterator[None]:
    """Fail loudly if ``what`` ran Dynamo or Inductor: loading and serving must never compile."""
    before = compile_counts()
    yield
    delta = compile_counts() - before
    if delta.dynamo_graphs or delta.inductor_compiles:
        raise CompiledSomething(
            f"{what} compiled: {delta.dynamo_graphs} Dynamo graphs, {delta.inductor_compiles} Inductor compiles"
        )
