"""The runner's host staging buffer: uploads keep their values, and a queued copy out of the buffer
is never overwritten by the next step."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fluxlab.engine.staging import HostStaging, mapped_host


def test_upload_returns_each_array_and_the_buffer_grows_on_demand():
    staging = HostStaging(torch.device("cpu"), size=4)
    staging.begin()
    a, b = np.arange(3), np.arange(10, 17)
    got = staging.upload([a, b])
    assert [t.tolist() for t in got] == [a.tolist(), b.tolist()]
    host, source = staging.take(9)  # past the 4 it started with
    host[:] = np.arange(9) * 2
    assert source.tolist() == list(range(0, 18, 2)) and staging.host.shape[0] >= 9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_next_step_waits_for_a_copy_still_queued_behind_the_gpu():
    """A prefill-only step ends without a device->host copy: the next step's inputs must not
    overwrite the pinned region an earlier copy (queued behind a busy GPU) has not read yet."""
    cuda = torch.device("cuda")
    staging = HostStaging(cuda)
    staging.begin()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU work ahead of the copy
    (uploaded,) = staging.upload([np.array([1, 2, 3, 4])])
    staging.begin()
    again, _ = staging.take(4)
    again[:] = 9  # the same region, rewritten by the next step
    assert uploaded.tolist() == [1, 2, 3, 4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.long, torch.int32])  # graph inputs; a page-table backend's plan
def test_a_mapped_region_is_read_by_kernels_where_the_host_wrote_it(dtype):
    """What a graph's first kernel reads: the host's latest numpy writes, no copy call between."""
    cuda = torch.device("cuda")
    staging = HostStaging(cuda)
    host, on_device = mapped_host(6, cuda, dtype)
    assert on_device.device.type == "cuda" and on_device.data_ptr() == torch.from_numpy(host).data_ptr()
    assert on_device.dtype == dtype and host.dtype == torch.empty(0, dtype=dtype).numpy().dtype
    out = torch.zeros(6, dtype=dtype, device=cuda)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.add(on_device, 0, out=out)
    for values in ([1, 2, 3, 4, 5, 6], [7, 0, 7, 0, 7, 0]):
        host[:] = values
        graph.replay()
        staging.queued_read()
        staging.wait_read()
        assert out.tolist() == values
