"""The step's host->device traffic, through pinned memory the runner owns.

A CUDA call costs the host 30-130 µs on the H200 machine measured (a copy, an event, a launch;
docs/benchmarks.md §17), and the GPU idles while the host makes them between two forwards. So a
graph's inputs make none: each graph (and a page-table backend's plan under it) owns a pinned
region mapped into the GPU's address space (`mapped_host`), the host writes the next inputs there
with numpy and the graph's first kernels read them. What the rest of a step needs (eager inputs,
the decode step's indices, uploaded after the launch) goes through one transient int64 buffer
(`HostStaging.take`, `upload`).

Pinned memory is written again only once the GPU has read it: `upload` and `queued_read` record an
event after the step's reads are queued, and `begin` waits on it. A step that ends on a
device->host copy has waited already; one that does not (prefill chunks only) must not have its
inputs rewritten by the next step while the GPU has not read them yet.
"""
from __future__ import annotations

import numpy as np
import torch


_TYPESTR = {torch.long: "<i8", torch.int32: "<i4"}


class _MappedHostArray:
    """Pinned host memory as a CUDA array (unified addressing: the GPU reads it at its host
    address); holds the pinned tensor, so the alias keeps it alive."""

    def __init__(self, pinned: torch.Tensor):
        self.pinned = pinned
        self.__cuda_array_interface__ = {"shape": tuple(pinned.shape), "typestr": _TYPESTR[pinned.dtype],
                                         "data": (pinned.data_ptr(), False), "version": 3}


def mapped_host(n: int, device: torch.device, dtype: torch.dtype = torch.long) -> tuple[np.ndarray, torch.Tensor]:
    """n zeros of pinned host memory: (numpy view the host writes, the same memory as a device
    tensor kernels read; on CPU the host tensor itself). The GPU may be reading it until the work
    queued on it has run: write it only where the step's staging protocol allows (HostStaging.begin)."""
    on_cuda = device.type == "cuda"
    pinned = torch.zeros(n, dtype=dtype, pin_memory=on_cuda)
    alias = torch.as_tensor(_MappedHostArray(pinned), device=device) if on_cuda else pinned
    return pinned.numpy(), alias


class HostStaging:
    def __init__(self, device: torch.device, size: int = 1 << 14):
        self.device = device
        self.on_cuda = device.type == "cuda"
        self.read = torch.cuda.Event() if self.on_cuda else None
        self.in_flight = False
        self.used = 0
        self._allocate(size)

    def _allocate(self, size: int) -> None:
        # A replaced buffer may still be read by a queued copy: the pinned allocator keeps its
        # memory until the copies recorded on it have run.
        self.buffer = torch.empty(size, dtype=torch.long, pin_memory=self.on_cuda)
        self.host = self.buffer.numpy()

    def begin(self) -> None:
        """A new step: its buffer from the start, once the GPU has read what the last step staged."""
        self.wait_read()
        self.used = 0

    def wait_read(self) -> None:
        """Until the GPU has read what was staged for the work queued so far (rarely a wait at all:
        a decoding step ends on a device->host copy)."""
        if self.in_flight:
            self.read.synchronize()
            self.in_flight = False

    def take(self, n: int) -> tuple[np.ndarray, torch.Tensor]:
        """The next n int64 of this step's buffer, as (numpy view to fill, tensor view to copy)."""
        if self.used + n > self.host.shape[0]:
            self._allocate(max(2 * self.host.shape[0], self.used + n))
            self.used = 0
        start = self.used
        self.used += n
        return self.host[start:start + n], self.buffer[start:start + n]

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """int64 arrays on the device, one copy for all of them."""
        sizes = [a.shape[0] for a in arrays]
        if not self.on_cuda:  # the tensors are the host arrays themselves: one fresh concatenation
            return torch.from_numpy(np.concatenate(arrays)).split_with_sizes(sizes)
        host, source = self.take(sum(sizes))
        np.concatenate(arrays, out=host)
        packed = source.to(self.device, non_blocking=True)
        self.queued_read()
        return packed.split_with_sizes(sizes)  # no torch.split wrapper: ~2 µs a step

    def drained(self) -> None:
        """The host has waited for the stream (a device->host copy behind every queued read)."""
        self.in_flight = False

    def queued_read(self) -> None:
        """The GPU work queued so far reads staged memory: the next step waits for it."""
        if self.on_cuda:
            self.read.record()
            self.in_flight = True
