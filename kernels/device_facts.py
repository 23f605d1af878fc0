"""Facts of the CUDA device a launch runs on, each looked up once a device: a wrapper asks them every call, and
torch's lookups cost microseconds of host time each."""
import functools

import torch
import triton


def cuda_index(device: torch.device) -> int:
    """The CUDA device index ``device`` names; a bare ``torch.device("cuda")`` names the current
    device (``torch.cuda.set_device``), not device 0."""
    return torch.cuda.current_device() if device.index is None else device.index


@functools.lru_cache(maxsize=None)
def capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device):
    """The SMs of a CUDA device; None elsewhere (the interpreter)."""
    return sm_count(cuda_index(device)) if device.type == "cuda" else None


@functools.lru_cache(maxsize=None)
def max_shared_mem(index: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
