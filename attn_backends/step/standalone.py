"""A backend used without a runner (a test, the suite's eager side, a third-party caller): the
runner's part of a step, done with the same :class:`Step` calls, so that the backend reads a view
made exactly as a runner makes it."""
from __future__ import annotations

from typing import Optional

from .. import layout as _layout
from ..batch import ForwardBatch, GraphInputs
from ..validation import LayoutError, check_request_rows
from .step import Step
from .view import StepView, built_from


class StandaloneStep:
    """The view a backend reads: the caller's (``batch.step``, ``GraphInputs.step``), or one made
    here from the caller's tensors: an eager step kept across batches (its library state too),
    and a graph step sized by :meth:`reset` (the backend's ``init_cuda_graph_state``)."""

    def __init__(self, memory, fill_of) -> None:
        self.memory, self._fill_of = memory, fill_of      # the backend's fill value, read at first use
        self._eager: Optional[Step] = None
        self._graph: Optional[Step] = None
        self._size: Optional[tuple] = None

    def reset(self, max_bs: int, max_width: int) -> None:
        self._size, self._graph = (max_bs, max_width), None

    def eager(self, batch: ForwardBatch) -> StepView:
        view = batch.step
        if view is None:
            if self._eager is None:
                self._eager = Step(self.memory, self._fill_of())
            return self._eager.build(batch).step
        built = view.built_from
        if view.key is not None or view.raw_bs != batch.raw_bs or view.layout.mode != batch.forward_mode or \
                not built or any(a is not b for a, b in zip(built, built_from(batch))):
            raise LayoutError("the step holds no layout for this batch: build the step of each batch "
                              "(attn_backends.step.eager_step) and pass the batch it returns to every backend")
        return view

    def capture(self, inputs: GraphInputs) -> StepView:
        if inputs.step is not None:
            return self._checked(inputs)
        if not _layout.stream_capturing():                # the caller's rows (a sync): all on row 0 is a
            rows = inputs.req_pool_indices[:inputs.raw_bs]    # stand-in (SGLang captures so), else real
            check_request_rows(rows, self.memory.req_to_token.shape[0], stand_in=bool((rows == 0).all()))
        return self._graph_step().capture_inputs(inputs)   # validates first: a refusal changes nothing

    def replay(self, inputs: GraphInputs) -> StepView:
        view = inputs.step
        if view is not None:                              # a runner's: the view of this key (the hot path)
            return view if view.key is inputs.key else self._checked(inputs)
        key, step = inputs.key, self._graph
        if step is None or key not in step.captured_keys():
            have = ", ".join(sorted(map(str, step.captured_keys()))) if step is not None else ""
            raise LayoutError(f"no graph captured for {key} without a runner's step; captured: {have or 'none'}")
        return step.update_inputs(inputs)

    @staticmethod
    def _checked(inputs: GraphInputs) -> StepView:
        view = inputs.step
        if view.key is not inputs.key and view.key != inputs.key:
            raise LayoutError(f"the step view is for {view.key}, not {inputs.key}: the runner must hand the "
                              "view that its step's capture() or update() returned for this key")
        return view

    def _graph_step(self) -> Step:
        if self._size is None:
            raise LayoutError("init_cuda_graph_state() must run before capture")
        if self._graph is None:
            max_bs, max_width = self._size
            self._graph = Step(self.memory, self._fill_of(), max_bs=max_bs, max_width=max_width)
        return self._graph

    @property
    def graph_step(self) -> Optional[Step]:
        """The graph step made here (None until a capture without the caller's step)."""
        return self._graph
