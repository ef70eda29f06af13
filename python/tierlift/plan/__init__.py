"""tierlift.plan: where each kind of training state will live, and how long a step will take,
before anything runs (`python -m tierlift plan --params 8e9 --gpu-mem 80G ...`), or the
largest model that fits the budgets (`--max-params`)."""

from tierlift.plan.measure import Bandwidths, measure
from tierlift.plan.planner import Plan, PlanInput, make_plan, max_params, parse_bytes

__all__ = ["Bandwidths", "Plan", "PlanInput", "make_plan", "max_params", "measure", "parse_bytes"]
