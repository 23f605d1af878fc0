"""The step: what one forward step of every layer and backend reads, built once, and the frozen
view of it that backends are handed."""
from .eager import eager_step, eager_steps_of, fill_of
from .group import StepGroup
from .standalone import StandaloneStep
from .step import Step
from .view import LibraryKey, Prep, StepView, prep_placement

__all__ = ["LibraryKey", "Prep", "StandaloneStep", "Step", "StepGroup", "StepView", "eager_step", "eager_steps_of",
           "fill_of", "prep_placement"]
