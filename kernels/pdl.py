"""Programmatic dependent launch (sm_90+): a merge launched as a dependent of the pass that writes its partials
may start before that pass has ended, and reads nothing that pass writes before ``gdc_wait`` (the pass complete,
its stores visible). A pass that calls ``gdc_launch_dependents`` at its start lets the merge launch once every one
of its programs has started (the merge's programs then take SMs as the pass's programs leave them); otherwise as
they exit. The flags are read when a wrapper launches (a recorded eager replay keeps what it recorded;
bench/RESULTS.md, 'Ragged batches': measured both ways)."""
import torch
import triton

from .device_facts import capability, cuda_index

MERGE_PASS_PDL = True       # the chunk schedule's merge pass (``schedule.ChunkLaunch.merge_pass``)
CHUNK_PDL_TRIGGER = True    # the GQA chunk passes trigger at their start (with MERGE_PASS_PDL: ChunkLaunch.trigger)
SPLIT_MERGE_PDL = True      # ``attention_core.merge_splits``; the GQA decode split pass triggers at its start


def pdl_device(device: torch.device) -> bool:
    """Whether ``device`` runs programmatic dependent launches (an sm_90+ NVIDIA GPU; not the interpreter)."""
    return (device.type == "cuda" and torch.version.hip is None and not triton.knobs.runtime.interpret
            and capability(cuda_index(device))[0] >= 9)


def merge_pass(device: torch.device) -> bool:
    """The chunk schedule's merge pass launched as a dependent (``MERGE_PASS_PDL``)."""
    return MERGE_PASS_PDL and pdl_device(device)


def split_merge(device: torch.device) -> bool:
    """``merge_splits`` launched as a dependent of the split pass (``SPLIT_MERGE_PDL``), which triggers at its start."""
    return SPLIT_MERGE_PDL and pdl_device(device)
