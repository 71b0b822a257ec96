"""A value one thread sets for the length of a block, as each model's engine steps in a thread of its own while
another model may load or profile in another: the forward context the attention op reads, the process group the
tensor-parallel all-reduce sums over, the runner the compiled pieces are called through."""

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


class ThreadValue(Generic[T]):
    def __init__(self):
        self._local = threading.local()

    def get(self) -> T | None:
        """This thread's value, or None outside any ``set`` block."""
        return getattr(self._local, "value", None)

    @contextmanager
    def set(self, value: T) -> Iterator[None]:
        """``value`` for this thread while the block runs; the one before it again after."""
        previous = self.get()
        self._local.value = value
        try:
            yield
        finally:
            self._local.value = previous
