"""Starting the other ranks of a tensor-parallel model: one process each, spawned as the load begins so that they
build and load their shards while rank 0 (this process) does its own, joined into one gloo group at the end.

Each rank gets its spec on stdin (what to build, the bundle and the keys to verify it with, the store's port) and
answers one line on stdout: ready, or the error that stopped it, which fails the load with the rank's status.

On CUDA rank r runs on the host's r-th visible GPU (this process, rank 0, on the first), which its process sees as
cuda:0: its CUDA_VISIBLE_DEVICES names that GPU first and every other after it. The compiled code of the bundle
names device 0 (Inductor writes the compile's device index into its kernels' launches and allocations), so each rank
must see its own GPU as device 0; the others stay visible because NCCL's peer-to-peer transports between processes
need the peer GPU visible (hidden, NCCL falls back to copies through host memory).
"""

import datetime
import json
import logging
import os
import select
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from exec_service.engine.parallel.rank_group import RankGroup
from exec_service.startup.fetch import FetchedBundle
from exec_service.startup.process_groups import join_groups
from exec_service.startup.rank_worker import engine_config_fields
from kiln.errors import KilnError, Unavailable
from kiln.model.roots import PinnedDir
from kiln.model.spec import ResolvedModel
from kiln.store.signing import TrustedKeys

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 600.0  # for every rank to build its shard and load the bundle
# For the other ranks to meet a collective of a step: they run the same work, so only a stuck rank is this late.
STEP_TIMEOUT_S = 60.0
_ERRORS = {cls.code: cls for cls in (KilnError, *KilnError.__subclasses__())}


def visible_gpus() -> list[str]:
    """The GPUs this process sees, in its order, as CUDA_VISIBLE_DEVICES names them (indices or UUIDs)."""
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    if named is not None:
        return [gpu.strip() for gpu in named.split(",") if gpu.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def rank_gpus(rank: int, visible: list[str]) -> str:
    """CUDA_VISIBLE_DEVICES for ``rank``: its GPU first (its cuda:0), then every other in order."""
    return ",".join([visible[rank], *visible[:rank], *visible[rank + 1:]])


class StartingRanks:
    """Ranks 1..N-1 of one model, spawned, not yet joined."""

    def __init__(self, name: str, size: int, store: dist.TCPStore, processes: list[subprocess.Popen]):
        self.name = name
        self.size = size
        self.store = store
        self.processes = processes
        self.group: RankGroup | None = None  # once joined

    @classmethod
    def spawn(cls, name: str, resolved: ResolvedModel, engine_config, weights: str, weights_dir: PinnedDir | None,
              weights_seed: int, fetched: FetchedBundle | None, trusted: TrustedKeys) -> "StartingRanks":
        """``weights``: "dummy", or the view of ``weights_dir``, whose descriptors each rank inherits to read it."""
        size = engine_config.tensor_parallel_size
        timeout = datetime.timedelta(seconds=JOIN_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=timeout, wait_for_workers=False)
        spec = {
            "model": resolved.name, "model_config": resolved.config.to_json_string(use_diff=False),
            "dtype": resolved.dtype_name, "weights": weights, "weights_seed": weights_seed,
            "engine_config": engine_config_fields(engine_config), "store_port": store.port,
            "timeout_s": JOIN_TIMEOUT_S, "step_timeout_s": STEP_TIMEOUT_S,
            "bundle": str(fetched.path) if fetched else None,
            "key": fetched.key if fetched else "", "compile_sizes": list(fetched.compile_sizes) if fetched else [],
            "trusted_keys": [key.public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo).decode()
                             for key in trusted.keys.values()],
        }
        processes = []
        visible = visible_gpus() if engine_config.device == "cuda" else []
        try:
            for rank in range(1, size):
                env = {**os.environ, "CUDA_VISIBLE_DEVICES": rank_gpus(rank, visible)} if visible else None
                process = subprocess.Popen([sys.executable, "-m", "exec_service.startup.rank_worker"],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                           pass_fds=weights_dir.descriptors if weights_dir else ())
                processes.append(process)
                process.stdin.write(json.dumps({**spec, "rank": rank}))
                process.stdin.close()
        except BaseException:
            cls(name, size, store, processes).abandon()
            raise
        log.info("%s: started ranks 1..%d (pids %s)", name, size - 1, ", ".join(str(p.pid) for p in processes))
        return cls(name, size, store, processes)

    def join(self, device: str) -> RankGroup:
        """Wait until every rank is ready and form the groups. Any failure ends the ranks and raises the one that
        stopped them; after it, ``RankGroup.close`` ends them."""
        try:
            deadline = time.monotonic() + JOIN_TIMEOUT_S
            for rank, process in enumerate(self.processes, start=1):
                self._wait_ready(rank, process, deadline)
            control, collective = join_groups(self.store, 0, self.size, device,
                                              datetime.timedelta(seconds=STEP_TIMEOUT_S))
        except BaseException:
            self.abandon()
            raise
        self.group = RankGroup(self.name, control, collective, self.processes)
        return self.group

    def _wait_ready(self, rank: int, process: subprocess.Popen, deadline: float) -> None:
        ready, _, _ = select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = process.stdout.readline() if ready else ""
        if not ready:
            raise Unavailable(f"model: rank {rank} of {self.name!r} was not ready within {JOIN_TIMEOUT_S:.0f} s")
        if not line:
            raise Unavailable(f"model: rank {rank} of {self.name!r} exited while loading (status "
                              f"{process.wait()}); its log says why")
        answer = json.loads(line)
        if "error" in answer:
            error = answer["error"]
            raise _ERRORS.get(error["code"], KilnError)(error["message"])

    def abandon(self) -> None:
        """The load failed: end every rank."""
        if self.group is not None:
            self.group.abandon()
            return
        for process in self.processes:
            process.kill()
            process.wait()
