"""The names ``models.gpt`` exported before the package was split, for the callers that still import them here.

The stage is ``models.stage``, its build ``models.build``, its initialisation ``models.init``.
"""
from models.build import build_gpt, count_parameters
from models.init import InitialValues, initial_tp_value

__all__ = ["InitialValues", "build_gpt", "count_parameters", "initial_tp_value"]
