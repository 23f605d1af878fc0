"""The step: what one forward step of every layer and backend reads, built once."""
from .plan import LayoutPlan, load_rows_of_steps, step_plan

__all__ = ["LayoutPlan", "load_rows_of_steps", "step_plan"]
