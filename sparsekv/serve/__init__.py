"""Serving: many requests at once, joining and leaving the running batch at step boundaries (continuous
batching), each admitted when its KV fits. ``ServingEngine`` is the scheduler's loop (``scheduler``); the model
runs in ``runner``."""

from .runner import Logprobs
from .scheduler import Event, PrefillPacer, QueueFull, Request, RequestError, ServingEngine

__all__ = ["Event", "Logprobs", "PrefillPacer", "QueueFull", "Request", "RequestError", "ServingEngine"]
