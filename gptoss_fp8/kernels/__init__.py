"""Triton kernels, one file each with its launcher and plain-torch reference; launcher helpers here."""

from __future__ import annotations

import functools

import torch


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, for persistent and split-KV grids; 4 off the GPU
    (the interpreter: a few programs still exercise the loops over tiles / splits)."""
    if device.type != "cuda":
        return 4
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sm_count(index: int) -> int:
    # get_device_properties costs ~20 us a call on the H200 machine (measured): once per device
    return torch.cuda.get_device_properties(index).multi_processor_count


_COUNTERS: dict[torch.device, torch.Tensor] = {}
# Buffers replaced by a larger one stay alive: a CUDA graph captured earlier keeps their address.
_RETIRED: list[torch.Tensor] = []


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters (at least ``n``) for the split-K semaphore pattern: the
    splits of one output tile count their arrival with an acq_rel ``atomic_add`` and the last one
    reduces the partials and resets its counter to 0, so the buffer is zeroed again after every
    launch. One buffer per device, shared by every kernel using the pattern (kernels on one stream
    run one after another; calls on one device must not run concurrently on several streams)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def device_ints(values, device: torch.device | str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Host ints (a list or a numpy array) as a tensor on ``device`` without a host synchronisation: on CUDA copied
    from pinned memory, asynchronously (a copy from pageable memory waits for everything queued on the stream first,
    e.g. the decode step launched just before a serving step's prompt chunks; the pinned block is not reused before
    the copy ends)."""
    t = torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
