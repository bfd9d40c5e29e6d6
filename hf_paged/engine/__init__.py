"""Continuous batching over the global block pool: `Engine`, its requests, options and statistics."""

from .engine import Engine
from .params import SamplingParams
from .request import RequestOutput
from .stats import EngineStats

__all__ = ["Engine", "EngineStats", "RequestOutput", "SamplingParams"]
