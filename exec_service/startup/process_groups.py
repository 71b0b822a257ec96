"""The process groups of a tensor-parallel model's ranks, formed alike by rank 0 and by every other rank.

The control group is gloo on every device: the step broadcast's header, the KV cache's agreed size and stop are host
values. The collective group runs the sharded layers' all-reduce: on the CPU it is the control group itself; on
CUDA it is NCCL, one rank per GPU (each rank's own GPU is its cuda:0: exec_service.startup.ranks).

CUDA graphs capture the NCCL all-reduce through c10d's ProcessGroupNCCL itself, not a communicator of Kiln's own.
vLLM wraps NCCL with ctypes (pynccl) because, when it was written, ``torch.distributed.all_reduce`` called CUDA APIs
that a capture forbids (its watchdog queried the captured work's events); since pytorch/pytorch#103503 (2023)
ProcessGroupNCCL leaves captured work out of its watchdog, and PyTorch's own test_c10d_nccl.py
(``test_allreduce_in_cudagraph``) captures ``pg.allreduce(xs).wait()`` inside ``torch.cuda.graph`` and replays it.
What that test needs, this does: each rank's GPU its current device, and one all-reduce run eagerly before any
capture, which creates the NCCL communicator (made lazily at the first collective, which must not be inside a
capture). NCCL's own settings are the environment's (tests and benches set NCCL_NVLS_ENABLE=0 on shared hosts);
Kiln sets none.

One torch setting is Kiln's unless the operator set it: TORCH_NCCL_ASYNC_ERROR_HANDLING=0. torch's default (3) ends
the process when its watchdog sees an NCCL error or timeout, and rank 0 is the execute service, serving every other
model too; its other mode (2) aborts the communicator on the watchdog's thread, where the abort waits for every CUDA
graph that captured the communicator's calls (vllm-project/vllm#39846) and the stuck watchdog gets the process
killed by torch's heartbeat monitor. Kiln handles the failure itself instead (RankGroup: the model is lost and the
communicator aborted on a thread of its own).
"""

import datetime
import os

import torch
import torch.distributed as dist


def join_groups(store: dist.Store, rank: int, size: int, device: str,
                timeout: datetime.timedelta) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(control, collective) for ``rank`` of ``size``; ``timeout`` bounds a step's collectives."""
    control = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
    if device != "cuda":
        return control, control
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")  # read as the group is made; why: above
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    collective = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size, options)
    first = torch.ones(1, device="cuda")
    collective.allreduce([first]).wait()
    torch.cuda.synchronize()
    return control, collective
